"""Flag checks the benchmark scripts share, registered as absl validators: absl runs them when it parses the command
line, so a bad value stops the script at startup (message naming the flag, exit code 1) before any work starts."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

from absl import flags

from nki_kernels import hardware


def _validator(name: str, check: Callable[[object], str | None]) -> None:
    """Registers check(value) -> None when the value is good, else what was expected."""

    def validate(value):
        problem = check(value)
        if problem:
            raise flags.ValidationError(f"--{name}: {problem}")
        return True

    flags.register_validator(name, validate)


def fraction(name: str) -> None:
    """A float flag must lie in (0, 1] (NaN and infinities refused: absl's own bounds let NaN through)."""
    _validator(name, lambda value: None if math.isfinite(value) and 0 < value <= 1 else f"got {value}, expected (0, 1]")


def target(name: str) -> None:
    """A string flag must name an NKI target (hardware.TARGET_ALIASES, e.g. trn1 or trn2)."""

    def check(value):
        try:
            hardware.canonical_target(value)
        except ValueError:
            return f"got {value!r}, expected one of {sorted(hardware.TARGET_ALIASES)}"
        return None

    _validator(name, check)


def int_list(name: str, minimum: int = 1) -> None:
    """A list flag must hold distinct integers >= minimum, at least one."""

    def check(values):
        try:
            numbers = [int(value) for value in values or ()]
        except ValueError:
            return f"got {values}, expected integers >= {minimum} (comma-separated)"
        if not numbers or min(numbers) < minimum or len(set(numbers)) != len(numbers):
            return f"got {values}, expected distinct integers >= {minimum}, at least one"
        return None

    _validator(name, check)


def choice_list(name: str, choices: Callable[[], Iterable[str]], *, optional: bool = False) -> None:
    """A list flag must hold distinct names from choices() (called at parse time), at least one; with optional, it
    may also be left empty or unset (meaning all)."""

    def check(values):
        if not values and optional:
            return None
        known = list(choices())
        if not values or not set(values) <= set(known) or len(set(values)) != len(values):
            return f"got {values}, expected distinct names from {known}, at least one"
        return None

    _validator(name, check)


def directory_with(name: str, inside: str, what: str) -> None:
    """A string flag, when given, must be a directory holding the folder `inside` (a checkout of `what`)."""

    def check(value):
        if value is None or os.path.isdir(os.path.join(os.path.expanduser(value), inside)):
            return None
        return f"{value!r} has no {inside} folder; expected a checkout of {what}"

    _validator(name, check)


def output_directory(name: str) -> None:
    """A string flag naming where results go must not be empty or an existing non-directory."""

    def check(value):
        if not value:
            return "got an empty path, expected a directory for the results"
        if os.path.exists(value) and not os.path.isdir(value):
            return f"{value!r} is a file, expected a directory for the results"
        return None

    _validator(name, check)


def not_with(flag: str, others: Iterable[str], why: str) -> None:
    """Refuses any flag of `others` given on the command line together with the bool flag `flag` (which overrides
    them: a value given there would be silently ignored)."""
    others = tuple(others)

    def check(values):
        given = [f"--{other}" for other in others if flags.FLAGS[other].present]
        if values[flag] and given:
            raise flags.ValidationError(f"--{flag} {why}; it cannot be combined with {', '.join(given)}")
        return True

    flags.register_multi_flags_validator([flag, *others], check)


def unused(names: Iterable[str], script: str) -> None:
    """Refuses the flags `names` on the command line: defined by a module `script` imports (the accuracy report's),
    but not read by `script`, so a value given there would be silently ignored."""
    names = tuple(names)

    def check(_):
        given = [f"--{name}" for name in names if flags.FLAGS[name].present]
        if given:
            raise flags.ValidationError(f"{', '.join(given)}: not used by {script} (the accuracy report's flags)")
        return True

    flags.register_multi_flags_validator(list(names), check)
