"""The one exception class for violations of Trainium hardware rules."""


class NkiHardwareError(ValueError):
    """A kernel did something the NeuronCore cannot do (tile too large, wrong memory, capacity exceeded, ...).

    The message names the instruction and the kernel source line (file.py:LINE) that issued it.
    """


class NkiCollectiveError(ValueError):
    """A `nki.collectives` call that breaks the documented rules (replica groups, shapes, memories), or ranks of
    one simulate_spmd launch that issue different collectives at the same step.

    The message names the collective and the kernel source line (file.py:LINE) of every rank involved.
    """


class NkiDeadlockError(RuntimeError):
    """Ranks of a simulate_spmd launch that can never meet: one waits in a collective that another rank never
    reaches (it returned, failed, or ran past the rendezvous timeout). The message gives each rank's file:line."""
