"""The systemd manager over D-Bus: a unit's properties read and set at runtime (jeepney, blocking).

Thin edge: Manager.SetUnitProperties(name, runtime=True, [(property, variant)]) and
Properties.Get on the unit's object. runtime=True writes systemd's own runtime drop-in
(/run/systemd/system.control/UNIT.d/): kept across daemon-reload, gone at reboot, never a file
of ours. Over the system bus (dbus-daemon or dbus-broker; root may call SetUnitProperties): systemd's
private socket (/run/systemd/private, systemctl's as root) never answered jeepney's calls under
systemd 252 (checked in the test container), so it is not used. jeepney: pure Python, blocking
calls with a timeout from the loop thread, no libdbus. Every failure (no bus, a refused value,
an unknown unit) is a SystemdError.
"""

from __future__ import annotations

from typing import Any

from turbonode.errors import TurbonodeError

SYSTEM_BUS = "/run/dbus/system_bus_socket"
DEST = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
TIMEOUT_S = 5.0
# a unit's interface by its suffix: where its cgroup properties are
INTERFACES = {
    ".service": "org.freedesktop.systemd1.Service",
    ".slice": "org.freedesktop.systemd1.Slice",
    ".scope": "org.freedesktop.systemd1.Scope",
}


class SystemdError(TurbonodeError):
    """systemd could not be reached over D-Bus, or refused a call."""


class SystemdBus:
    """One connection to systemd, opened at the first call and again after a failure."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._conn: Any = None

    def _connect(self) -> Any:
        if self._conn is None:
            from jeepney.io.blocking import DBusConnection, prep_socket

            path = self.path or SYSTEM_BUS
            try:
                sock = prep_socket(path, timeout=TIMEOUT_S)
            except OSError as exc:  # socket.timeout included
                raise SystemdError(f"cannot connect to the system bus at {path}: {exc}") from None
            try:
                self._conn = DBusConnection(sock)  # says Hello to the bus
            except Exception as exc:  # noqa: BLE001 - jeepney raises its own or OSError at Hello
                sock.close()
                raise SystemdError(f"the system bus at {path} refused us: {exc}") from None
        return self._conn

    def call(self, path: str, interface: str, method: str, signature: str, body: tuple) -> tuple:
        from jeepney import DBusAddress, DBusErrorResponse, new_method_call
        from jeepney.wrappers import unwrap_msg

        msg = new_method_call(DBusAddress(path, bus_name=DEST, interface=interface), method, signature, body)
        conn = self._connect()
        try:
            reply = conn.send_and_get_reply(msg, timeout=TIMEOUT_S)
            return tuple(unwrap_msg(reply))
        except DBusErrorResponse as exc:
            detail = " ".join(map(str, exc.data))
            raise SystemdError(f"systemd refused {method}{body[:1]}: {exc.name}: {detail}") from None
        except (OSError, ValueError) as exc:  # TimeoutError included
            self.close()
            raise SystemdError(f"{method} over D-Bus failed: {type(exc).__name__} {exc}".rstrip()) from None

    def set_properties(self, unit: str, properties: list[tuple[str, tuple[str, Any]]]) -> None:
        """SetUnitProperties(unit, runtime=True, properties): (name, (signature, value)) each."""
        self.call(MANAGER_PATH, f"{DEST}.Manager", "SetUnitProperties", "sba(sv)", (unit, True, properties))

    def get_property(self, unit: str, name: str) -> Any:
        (path,) = self.call(MANAGER_PATH, f"{DEST}.Manager", "LoadUnit", "s", (unit,))
        (variant,) = self.call(path, "org.freedesktop.DBus.Properties", "Get", "ss", (interface_of(unit), name))
        return variant[1]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def interface_of(unit: str) -> str:
    suffix = unit[unit.rfind(".") :]
    if suffix not in INTERFACES:
        raise SystemdError(f"{unit}: not a service, slice or scope: no cgroup properties")
    return INTERFACES[suffix]
