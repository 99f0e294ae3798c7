"""The launcher: the first code that runs in the sandbox. The interpreter runs this file's code as ``python -I
-S -c CODE grpokit-sandbox KEY=VALUE...`` (compiled by the trainer, or as text for another interpreter); it
imports nothing of grpokit (nothing of it is visible in the sandbox) and nothing slow (no json or re; ctypes only
in the process isolation), since it runs once per program.

It sets the resource limits, drops to the unprivileged uid where it starts as root, tells the trainer on the
status pipe that the program is starting (so that a failure before that is the sandbox's, not the program's),
and runs ``main.py`` in this same interpreter as ``__main__``: one interpreter start per program, not two.

Under bwrap, the PID namespace ends every process of the program with it. The ``process`` isolation has no
namespace, so there the launcher forks: the child puts up its walls (:func:`confine`: a seccomp filter, and
Landlock's rules on files, TCP, signals and ptrace) and runs the program, the parent supervises it — enforces the
wall clock, then kills every process the program left, including ones that ``setsid`` or double-fork (as root:
every process of the run's own uid, with ``kill(-1)`` from that uid; otherwise: every child of the parent, which is
the program's subreaper), and writes the program's wait status to the status pipe."""

import os
import resource
import sys

MARKER = "grpokit-sandbox"  # argv[1]: what leftovers() looks for in a process's command line
LIMITS = ("CPU", "AS", "NPROC", "FSIZE", "NOFILE", "CORE")
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# Landlock (Linux >= 5.13): its syscalls, and the ABI that scopes signals (Linux >= 6.12): a confined program can
# signal and ptrace only its own processes, whatever its uid
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_SIGNAL_ABI = 6
READ, READ_WRITE_FILE = 0b1101, 0b100_0000_0000_0110  # execute + read file + read dir; write + read + truncate
DEVICES = ("/dev/zero", "/dev/random", "/dev/urandom")  # read only; /dev/null read and write
# Syscalls a confined program is refused (EPERM), by machine: socket (no network, no Unix socket to the user's
# session bus or a container daemon; socketpair stays), ptrace and process_vm_* (another process's memory), and
# io_uring (whose operations seccomp does not see)
SECCOMP = {"x86_64": (0xC000003E, (41, 101, 310, 311, 425)), "aarch64": (0xC00000B7, (198, 117, 270, 271, 425))}


def parse(argv: list) -> dict:
    """``KEY=VALUE`` arguments → a dict; integer values are ints."""
    config = {}
    for item in argv:
        key, _, value = item.partition("=")
        config[key] = int(value) if value.lstrip("-").isdigit() else value
    return config


def own_process_count(uid: int) -> int:
    """How many processes (threads included: RLIMIT_NPROC counts tasks) ``uid`` runs now."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:  # it ended meanwhile
                pass
    return count


def set_limits(config: dict) -> None:
    processes = config["NPROC"]
    if config.get("nproc_relative"):
        # Not root and no uid of its own: RLIMIT_NPROC counts all of the user's processes, so the bound is
        # the user's count now plus the program's allowance.
        processes += own_process_count(os.getuid())
    for name in LIMITS:
        value = processes if name == "NPROC" else config[name]
        # CPU: SIGXCPU at the soft limit, SIGKILL a second later if the program ignores it
        hard = value + 1 if name == "CPU" else value
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, hard))


def drop_privileges(config: dict) -> None:
    """As root (bwrap without a user namespace, or the process isolation): become the run's own uid, which
    also clears every capability. Verified, not assumed."""
    if os.getuid() != 0 or "uid" not in config:
        return
    uid, gid = config["uid"], config["gid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise SystemExit(f"{MARKER}: could not drop to uid {uid}")
    try:
        os.setuid(0)
    except PermissionError:
        return
    raise SystemExit(f"{MARKER}: uid 0 could be regained after the drop")


def prctl(option: int, value: int, pointer: int = 0) -> None:
    import ctypes  # only the process isolation needs it (5 ms)

    if ctypes.CDLL(None, use_errno=True).prctl(option, value, ctypes.c_void_p(pointer), 0, 0) != 0:
        raise SystemExit(f"{MARKER}: prctl({option}) failed: {os.strerror(ctypes.get_errno())}")


def run_program(config: dict) -> None:
    """Run ``config["main"]`` as ``__main__``, as ``python main.py`` would (script dir on sys.path, ``exit``
    defined, the traceback without the launcher's frames, exit status 1 on an exception)."""
    import _sitebuiltins
    import builtins

    builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
    builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    if config.get("site"):
        import site

        site.main()
    path = config["main"]
    sys.argv[:] = [os.path.basename(path)]
    sys.path.insert(0, os.path.dirname(path))
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    excepthook, launcher_file = sys.excepthook, sys._getframe().f_code.co_filename
    try:
        with open(path, "rb") as file:
            source = file.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as error:
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename == launcher_file:
            trace = trace.tb_next
        excepthook(type(error), error.with_traceback(trace), trace)
        raise SystemExit(1) from None


def report(fd: int, message: str) -> None:
    os.write(fd, message.encode() + b"\n")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is disabled)."""
    import ctypes

    if not sys.platform.startswith("linux"):  # the syscall's number is Linux's
        return 0
    abi = ctypes.CDLL(None, use_errno=True).syscall(LANDLOCK_CREATE_RULESET, None, 0, 1)  # 1: the version
    return max(abi, 0)


def landlock(readable: list, workdir: str) -> None:
    """Confine this process and all it starts: files only under ``readable`` (read and execute) and ``workdir``
    (anything); no TCP; no signal, ptrace or abstract Unix socket outside the program's own processes."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = landlock_abi()
    if abi < 1:
        raise SystemExit(f"{MARKER}: the kernel has no Landlock")
    every = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # the file rights this ABI knows
    # the files, TCP bind and connect (ABI 4), abstract Unix sockets and signals (ABI 6); an older kernel
    # reads the fields it knows, the others being zero
    handled = (ctypes.c_uint64 * 3)(every, 0b11 if abi >= 4 else 0, 0b11 if abi >= LANDLOCK_SIGNAL_ABI else 0)
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, handled, ctypes.sizeof(handled), 0)

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    rules = [(path, READ) for path in [*readable, "/proc/self"]] + [(workdir, every)]  # self: this process's own
    rules += [("/dev/null", READ_WRITE_FILE)] + [(path, READ_WRITE_FILE & 0b100) for path in DEVICES]
    try:
        if ruleset < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # not on this system
                continue
            if not os.path.isdir(f"/proc/self/fd/{fd}"):
                access &= READ_WRITE_FILE | 0b1  # a file's rule holds file rights only
            rule = PathBeneath(access & every, fd)
            done = libc.syscall(LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0)  # 1: a path and beneath
            os.close(fd)
            if done != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
        if libc.syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    except OSError as error:
        raise SystemExit(f"{MARKER}: Landlock: {error}") from None
    finally:
        if ruleset >= 0:
            os.close(ruleset)


def seccomp() -> None:
    """Refuse this process and all it starts the syscalls in :data:`SECCOMP` (EPERM), and every syscall of
    another machine's ABI (i386's through int 0x80, x32's): the process is killed."""
    import ctypes

    machine = os.uname().machine
    if machine not in SECCOMP:
        raise SystemExit(f"{MARKER}: no seccomp filter for {machine} (x86_64 and aarch64 have one)")
    arch, refused = SECCOMP[machine]
    load, equal, at_least, give = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, kill, eperm = 0x7FFF0000, 0x80000000, 0x00050000 | 1
    deny_at = 6 + len(refused)  # the index of the last instruction, the refusal
    program = [(load, 0, 0, 4), (equal, 1, 0, arch), (give, 0, 0, kill), (load, 0, 0, 0),
               (at_least, deny_at - 4 - 1, 0, 0x40000000)]  # x32's syscall numbers have bit 30 set
    program += [(equal, deny_at - (5 + n) - 1, 0, nr) for n, nr in enumerate(refused)]
    program += [(give, 0, 0, allow), (give, 0, 0, eperm)]

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]

    filters = (Instruction * len(program))(*[Instruction(*op) for op in program])
    whole = Program(len(program), filters)  # kept alive (named) until the kernel has copied it
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(whole))


def confine(config: dict) -> None:
    """The process isolation's walls, the program's own from here on: seccomp's filter, and Landlock's where the
    trainer asked for it (``landlock=1``; the directories it may read in ``read``, one a line). Both need
    ``no_new_privs``, which the supervisor set before it forked this process."""
    seccomp()
    if config.get("landlock"):
        landlock(config["read"].split("\n"), os.path.dirname(config["main"]))


def start_program(config: dict) -> None:
    """In the program's own process: the uid drop, the walls, the "started" line, then the program."""
    drop_privileges(config)
    if config.get("supervise"):
        confine(config)
    report(config["status_fd"], "started")
    os.closerange(3, 1 << 16)  # the status pipe, the files bwrap copied: nothing of the sandbox's own
    run_program(config)


def wait_until(pid: int, deadline: float) -> int | None:
    """The wait status of child ``pid``, or None if it still runs at ``deadline`` (time.monotonic)."""
    import select
    import time

    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3: poll
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if pidfd is None:
                time.sleep(min(remaining, 0.005))
            else:
                select.select([pidfd], [], [], remaining)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def kill_everything_of(uid: int, gid: int) -> None:
    """Fork a child that kills every process of ``uid`` (the run's own) until none is left: ``kill(-1)`` from
    that uid reaches exactly those, wherever they moved. A child, so that the supervisor stays root. (kill(-1)
    does not say when none is left — it answers 0 while the machine has other processes — so /proc does.)"""
    import time

    if os.fork() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up:
            os.kill(-1, 9)
            if own_process_count(uid) <= 1:  # this one; a killed process counts until the supervisor reaps it
                os._exit(0)
            time.sleep(0.0005)
        os._exit(1)


def kill_children() -> None:
    """Kill this subreaper's children, and the orphans the kills reparent to it, until none is left."""
    me = str(os.getpid())
    for _ in range(10_000):
        children = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat", "rb") as file:
                    fields = file.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[1].decode() == me and fields[0] != b"Z":
                children.append(int(entry))
        if not children:
            return
        for child in children:
            try:
                os.kill(child, 9)
            except ProcessLookupError:
                pass
        reap(block=False)


def reap(block: bool) -> None:
    """Collect exited children (orphans of the program come to this subreaper); ``block``: until none is left."""
    try:
        while os.waitpid(-1, 0 if block else os.WNOHANG)[0] or block:
            pass
    except ChildProcessError:  # no child left
        pass


def supervise(config: dict) -> None:
    """The process isolation: fork the program, enforce the wall clock, kill what it left, report."""
    import time

    deadline = time.monotonic() + config["wall_ms"] / 1000
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the program come here, not to init: they can be found
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary raises the program's privileges
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        start_program(config)
        return
    report(config["status_fd"], f"child {pid}")  # the trainer's fallback, should this supervisor be killed
    status = wait_until(pid, deadline)
    if os.getuid() == 0 and "uid" in config:
        kill_everything_of(config["uid"], config["gid"])
    else:
        try:
            os.killpg(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        kill_children()
    if status is None:
        report(config["status_fd"], "timeout")
    else:
        report(config["status_fd"], f"exit {os.waitstatus_to_exitcode(status)}")
    reap(block=True)
    os._exit(0)


def main() -> None:
    if sys.argv[1:2] == [MARKER]:
        config = parse(sys.argv[2:])
        if config.get("reap"):  # the trainer's fallback: the supervisor missed its deadline
            kill_everything_of(config["uid"], config["gid"])
            reap(block=True)
            return
        set_limits(config)
        if config.get("supervise"):
            supervise(config)
        else:
            start_program(config)


if __name__ == "__main__":
    main()
