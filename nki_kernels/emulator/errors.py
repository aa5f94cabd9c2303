"""The one exception class for violations of Trainium hardware rules."""


class NkiHardwareError(ValueError):
    """A kernel did something the NeuronCore cannot do (tile too large, wrong memory, capacity exceeded, ...).

    The message names the instruction and the kernel source line (file.py:LINE) that issued it.
    """
