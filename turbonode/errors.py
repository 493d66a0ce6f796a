"""The project's own exceptions: OS, netlink and bcc errors are translated into these at the edge."""


class TurbonodeError(Exception):
    """Base for every error turbonode reports to a user."""


class ConfigError(TurbonodeError):
    """A configuration value is wrong; the message names the key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class RateError(TurbonodeError, ValueError):
    """A rate string such as '100mbit' could not be parsed."""


class ControlError(TurbonodeError):
    """The worker's control socket could not be reached or answered with an error."""

    def __init__(self, message: str, code: int | None = None, data: object = None):
        super().__init__(message)
        self.code = code
        self.data = data


class DatapathError(TurbonodeError):
    """The QoS datapath (HTB tree, classifier, pinned maps) could not be set up or read."""


class NoDeviceError(DatapathError):
    """The named interface or network namespace does not exist."""


class NotRootError(DatapathError):
    """The operation needs root (CAP_NET_ADMIN, CAP_BPF)."""


class BpfUnavailableError(DatapathError):
    """bcc is not importable, kernel headers are missing, or the kernel refused the program."""


class BackendUnavailable(TurbonodeError):
    """The requested model backend cannot run here (no GPU, missing package, engine build failed)."""
