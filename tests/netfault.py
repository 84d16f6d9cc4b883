"""Network partitions on loopback, with iptables, for the fault tests and the soak.

A :class:`Partition` drops every TCP packet to and from one ``address:port``
(both directions of every connection a client opened to that address), so
the server stays up and reachable at its other addresses: a client given
``127.0.0.2`` is cut off while one given ``127.0.0.1`` is not. The rules
carry a comment naming them, and :meth:`Partition.heal` removes them
however often they were added; tests heal in ``finally`` or a fixture.

iptables comes from Debian (``scripts/bootstrap.sh``); either backend
(nf_tables or legacy) will do, and the rules need root (``CAP_NET_ADMIN``).
"""

from __future__ import annotations

import os
import shutil
import subprocess

#: What every rule's comment starts with.
TAG = "celery_sched-test-partition"


def iptables_missing() -> str | None:
    """Why a partition cannot be made here, or None."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (scripts/bootstrap.sh installs it)"
    if os.geteuid() != 0:
        return "iptables rules need root"
    done = subprocess.run(
        ["iptables", "-w", "-S", "OUTPUT"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return f"iptables does not work here: {done.stderr.strip()}"
    return None


class Partition:
    """Packets to and from ``address:port`` dropped while it is on."""

    def __init__(self, address: str, port: int) -> None:
        self.address = address
        self.port = port
        self.comment = f"{TAG}-{address}:{port}"

    def _rules(self) -> list[list[str]]:
        # Every loopback packet passes OUTPUT once: the client's requests
        # (to address:port) and the server's replies (from it).
        tag = ["-m", "comment", "--comment", self.comment, "-j", "DROP"]
        return [
            ["OUTPUT", "-p", "tcp", "-d", self.address, "--dport", str(self.port), *tag],
            ["OUTPUT", "-p", "tcp", "-s", self.address, "--sport", str(self.port), *tag],
        ]

    def cut(self) -> None:
        for rule in self._rules():
            done = subprocess.run(
                ["iptables", "-w", "-I", *rule], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                self.heal()
                raise RuntimeError(f"iptables -I {' '.join(rule)}: {done.stderr.strip()}")

    def heal(self) -> None:
        for rule in self._rules():
            # -D removes one copy; a rule added twice needs two.
            while (
                subprocess.run(["iptables", "-w", "-D", *rule], capture_output=True).returncode == 0
            ):
                pass

    def __enter__(self) -> Partition:
        self.cut()
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()
