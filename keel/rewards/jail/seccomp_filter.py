"""The seccomp filter of a jailed run: the system calls a program in the jail is refused, as BPF
for bubblewrap's `--seccomp` (libseccomp through pyseccomp)."""

from __future__ import annotations

import logging
import tempfile
from functools import lru_cache

log = logging.getLogger("keel")

# Refused inside the jail (EPERM), as Docker's default profile refuses them: new namespaces (a user
# namespace would give the program every capability over mounts it makes, tmpfs of any size
# included), keyrings (the user's keyring outlives every run: a channel between samples), and
# kernel interfaces a judge never needs. clone3 passes its flags in memory a filter cannot read,
# so it answers ENOSYS and glibc falls back to clone, whose flags are checked.
_REFUSED_SYSCALLS = (
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "add_key",
    "keyctl",
    "request_key",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "memfd_create",
    "name_to_handle_at",
    "open_by_handle_at",
    "kexec_load",
    "init_module",
    "finit_module",
    "delete_module",
    "fsopen",
    "fsmount",
    "move_mount",
    "open_tree",
)


# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_NAMESPACE_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
    0x00000080,
)


@lru_cache(maxsize=1)
def seccomp_program() -> bytes | None:
    """The filter as BPF for bwrap --seccomp (libseccomp through pyseccomp), or None without it."""
    try:
        import pyseccomp as seccomp
    # not installed, or no libseccomp on this machine (pyseccomp raises RuntimeError)
    except Exception:
        return None
    import errno

    refuse = seccomp.ERRNO(errno.EPERM)
    program = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in _REFUSED_SYSCALLS:
        try:
            program.add_rule(refuse, name)
        # a call this libseccomp or architecture does not know
        except (ValueError, OSError, RuntimeError):
            log.debug("seccomp: %s unknown here, not filtered", name)
    for flag in _NAMESPACE_FLAGS:
        program.add_rule(refuse, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()
