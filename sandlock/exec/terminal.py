"""A pseudo-terminal of the tool's own in place of the caller's terminal.

A tool handed the caller's terminal (on stdin, stdout or stderr) could change its
settings (termios: ``ISIG`` and a ``VINTR``, ``VQUIT`` or ``VSUSP`` character the
terminal will see, a byte of its own answer to a query the tool writes) and so make the
terminal send the caller's foreground job SIGINT, SIGQUIT or SIGTSTP: the shell job or
agent that ran sandlock, and every other process in it. Leading a session of its own
keeps the tool from the terminal's signals, not from its settings.

So the tool never gets the caller's terminal. It gets a pseudo-terminal of its own
(pty(7)), its controlling terminal in its session, in place of each of stdin, stdout
and stderr that was a terminal, and the launcher copies bytes between the two, as
``ssh -t`` and script(1) do. Whatever the tool does to its terminal's settings, the
line discipline that obeys them is the pty's, and its signals go to the tool's own
process group.

- Interactive (stdin and stdout the same terminal, the launcher in its foreground
  group, ``sandlock run``): the caller's terminal is put in raw mode for the run and
  the pty gets its settings, so editors and REPLs work and Ctrl-C reaches the tool
  through the pty. The pty's suspend character starts disabled: a stopped tool with
  the terminal raw could be ended only by its timeout. Keys typed ahead for the shell
  while the tool runs are the tool's (as with ``ssh``).
- Otherwise (a pipeline, a background job, the API) the caller's terminal is left as it
  is, its Ctrl-C reaches the launcher (which forwards it), and the pty passes output
  unchanged. The tool gets no input from the caller's terminal: a terminal on stdin is
  replaced by /dev/null. A relay there would read keys eagerly, before any tool asked
  for them: keys meant for a pager beside it in the pipeline, or for the agent's own
  prompt, and type-ahead meant for the shell.

The settings the caller's terminal had are put back when the run ends; its size is
copied to the pty at the start and on each SIGWINCH (:meth:`Relay.resize`).

The relay never waits on the caller's terminal past the run: it reads and writes
through file descriptions of its own, non-blocking (the caller's are shared with the
shell and left as they are), so a terminal nobody drains, or a reader beside it that
takes a key first, cannot hold the launcher or the API caller. Once the tool has
exited, its last output is copied while the terminal takes it; output the terminal
takes none of for :data:`GRACE` seconds is dropped, and counted (:attr:`Relay.dropped`).
Where the terminal cannot be opened again (another user's terminal, after ``su``), the
caller's descriptions are used, blocking, and the relay is left behind after
:data:`GRACE` seconds if it is stuck in them.
"""

from __future__ import annotations

import fcntl
import os
import select
import termios
import threading
from typing import Any, Optional, Sequence

from ..errors import SetupError
from ..linux.process import is_terminal

#: termios(3)'s index of the output modes and of the control characters in tcgetattr's list.
_OFLAG, _CC = 1, 6
#: _POSIX_VDISABLE on Linux: a control character that never matches.
_DISABLED = b"\0"
#: The most bytes read at once from either side.
_CHUNK = 65536
#: Seconds the relay waits, once the tool has exited, for a caller's terminal that takes
#: nothing (and for its thread, stuck in a blocking description).
GRACE = 5.0


#: TIOCGPTN (``_IOR('T', 0x30, unsigned int)``, ioctl_tty(2)): a pty master's number;
#: answered by masters only.
_TIOCGPTN = 0x80045430


def _own_description(fd: int, flags: int) -> int:
    """The terminal ``fd`` is open on, opened again: a file description of the relay's
    own, non-blocking without touching the caller's. A dup of ``fd`` where it cannot be
    opened again as the same terminal: another user's (after su), or a pty master (its
    path is /dev/ptmx, which opens a new pty)."""
    try:
        fcntl.ioctl(fd, _TIOCGPTN, b"\0" * 4)
        return os.dup(fd)  # a master
    except OSError:
        pass
    try:
        own = os.open(f"/proc/self/fd/{fd}", flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)
    if os.fstat(own).st_rdev != os.fstat(fd).st_rdev:  # not the same terminal
        os.close(own)
        return os.dup(fd)
    return own


def _in_front(fd: int) -> bool:
    """Whether terminal ``fd`` is this process's controlling terminal with this process's
    group in front (a launcher in another session, or in the background, is not)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


class Relay:
    """The tool's pty and the thread that copies between it and the caller's terminal.

    Made when a terminal is among ``stdio``: what the tool would get as its stdin, stdout
    and stderr. :meth:`replace` gives it the pty's slave in place of each terminal
    (/dev/null in place of one on stdin, unless interactive); :attr:`slave` is its
    controlling terminal where the executor makes it one (``sandlock run``). :meth:`start`
    once the tool is forked; :meth:`close` once it has exited. ``interactive``: the
    caller's terminal may be put in raw mode and read (``sandlock run``, never a
    library's caller). Any failure to set it up is a :class:`SetupError`: the tool is
    never given the caller's terminal instead."""

    def __init__(self, stdio: Sequence[int], *, interactive: bool) -> None:
        terminals = [fd >= 0 and is_terminal(fd) for fd in stdio]
        self._terminals = terminals
        self.interactive = bool(interactive and terminals[0] and terminals[1]
                                and _in_front(stdio[0])
                                and os.fstat(stdio[0]).st_rdev == os.fstat(stdio[1]).st_rdev)
        self.caller_mode: Optional[list[Any]] = None
        self.dropped = 0  #: bytes of the tool's output the caller's terminal never took
        self.master = self.slave = self.input = self.output = self._null = -1
        self._stop_r = self._stop_w = -1
        self._to_caller = b""  # output read from the pty, not yet taken by the terminal
        self._thread: Optional[threading.Thread] = None
        #: Set by close() when the thread is stuck in a blocking description past GRACE:
        #: the thread then stops at its next step, and closes the descriptors itself.
        self._abandoned = False
        self._lock = threading.Lock()
        try:
            if self.interactive:
                self.input = _own_description(stdio[0], os.O_RDONLY)
            elif terminals[0]:  # no input from the caller's terminal (the docstring above)
                self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            shown = next((stdio[i] for i in (1, 2) if terminals[i]), -1)
            if shown >= 0:  # a pty only where the tool's output is shown (interactive too)
                self._open_pty(shown)
        except (OSError, termios.error) as exc:
            self._close_all()
            raise SetupError(f"cannot give the tool a terminal of its own in place of yours "
                             f"({exc}); without a terminal on its stdin, stdout and stderr "
                             "(</dev/null, output to a file or a pipe) it needs none") from None
        except BaseException:
            self._close_all()
            raise

    def _open_pty(self, shown: int) -> None:
        """The pty, with the settings of terminal ``shown`` (the caller's stdout or
        stderr), written through a description of the relay's own."""
        self.master, self.slave = os.openpty()
        self.output = _own_description(shown, os.O_WRONLY)
        mode = termios.tcgetattr(self.output)
        if self.interactive:
            mode[_CC][termios.VSUSP] = _DISABLED
        else:
            mode[_OFLAG] &= ~termios.OPOST
        termios.tcsetattr(self.slave, termios.TCSANOW, mode)
        self.resize()
        os.set_blocking(self.master, False)
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)

    def replace(self, stdio: Sequence[int]) -> tuple[int, int, int]:
        """``stdio`` with the pty's slave in place of each terminal (/dev/null in place of
        a terminal on stdin when not interactive)."""
        a, b, c = (self.slave if tty else fd for fd, tty in zip(stdio, self._terminals))
        return (self._null if self._null >= 0 else a), b, c

    def resize(self) -> None:
        """The caller's terminal's size, given to the pty (whose line discipline then
        sends the tool's group SIGWINCH)."""
        if self.master < 0:
            return
        try:
            size = fcntl.ioctl(self.output, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)
        except OSError:
            pass

    def start(self) -> None:
        """After the fork: the launcher's copy of the slave closed, the caller's terminal
        raw if interactive, the copying thread started. Nothing without a pty (a terminal
        on stdin alone, not interactive: /dev/null is all it takes)."""
        if self.master < 0:
            return
        os.close(self.slave)
        self.slave = -1
        if self.interactive:
            try:
                self.caller_mode = termios.tcgetattr(self.input)
                raw = termios.tcgetattr(self.input)
                raw[0] &= ~(termios.BRKINT | termios.ICRNL | termios.INPCK | termios.ISTRIP
                            | termios.IXON)
                raw[_OFLAG] &= ~termios.OPOST
                raw[2] = (raw[2] & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
                raw[3] &= ~(termios.ECHO | termios.ICANON | termios.IEXTEN | termios.ISIG)
                raw[_CC][termios.VMIN] = 1
                raw[_CC][termios.VTIME] = 0
                termios.tcsetattr(self.input, termios.TCSANOW, raw)
            except termios.error:  # its settings as they were: the pty's echo doubles it
                self.caller_mode = None
        self._thread = threading.Thread(target=self._copy, name="sandlock-terminal",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Once the tool has exited: the output it left copied while the caller's terminal
        takes it, the thread ended, the caller's terminal as it was, the pty closed."""
        abandoned = False
        try:
            if self._thread is not None:
                os.write(self._stop_w, b"x")
                self._thread.join(GRACE)
                with self._lock:  # stuck in a blocking description: it closes them itself
                    abandoned = self._abandoned = self._thread.is_alive()
                    if abandoned:
                        self._restore()  # before the thread may close the description
                self._thread = None
            if abandoned:  # it keeps its descriptors; its queue is lost
                self.dropped += len(self._to_caller)
            else:
                self._drain()
        finally:
            if not abandoned:
                self._restore()
                self._close_all()

    def _restore(self) -> None:
        """The caller's terminal's settings as they were (TCSANOW: TCSADRAIN would wait
        for a terminal nobody drains)."""
        if self.caller_mode is not None:
            try:
                termios.tcsetattr(self.input, termios.TCSANOW, self.caller_mode)
            except termios.error:
                pass
            self.caller_mode = None

    def _close_all(self) -> None:
        for fd in (self.master, self.slave, self._stop_r, self._stop_w, self.input,
                   self.output, self._null):
            if fd >= 0:
                os.close(fd)
        self.master = self.slave = self._stop_r = self._stop_w = -1
        self.input = self.output = self._null = -1

    def _copy(self) -> None:
        """The thread: pty output to the caller's terminal, the caller's input to the
        pty, until :meth:`close` says stop or the pty hangs up. Each side is waited on
        only while the other can take what it gives (no spin on a full side)."""
        try:
            self._copy_until_stopped()
        finally:
            with self._lock:
                if self._abandoned:
                    self._close_all()

    def _copy_until_stopped(self) -> None:
        to_pty = b""  # input read, not yet taken by the pty (its input queue is full)
        master_open = True
        while True:
            poller = select.poll()
            poller.register(self._stop_r, select.POLLIN)
            wanted = ((0 if self._to_caller or not master_open else select.POLLIN)
                      | (select.POLLOUT if to_pty and master_open else 0))
            if wanted:
                poller.register(self.master, wanted)
            if self._to_caller:
                poller.register(self.output, select.POLLOUT)
            if self.input >= 0 and not to_pty:
                poller.register(self.input, select.POLLIN)
            events = dict(poller.poll())
            if self._stop_r in events or self._abandoned:
                return
            if events.get(self.master, 0) & (select.POLLIN | select.POLLHUP | select.POLLERR):
                master_open = self._from_pty()
            if events.get(self.master, 0) & select.POLLOUT:
                to_pty = to_pty[self._to_pty(to_pty):]
            if self.output in events and self._to_caller:
                self._write_out()
            if self.input >= 0 and events.get(self.input, 0):
                data = self._read_input()
                if data is None:  # the caller's terminal is gone
                    os.close(self.input)
                    self.input = -1
                    data = b""
                to_pty = data[self._to_pty(data):]
            if not master_open and not self._to_caller:
                return

    def _from_pty(self) -> bool:
        """What the pty has, queued for the caller's terminal; False once it is hung up."""
        try:
            data = os.read(self.master, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:  # EIO: every slave closed
            return False
        if not data:
            return False
        self._to_caller += data
        self._write_out()
        return True

    def _write_out(self) -> None:
        """As much of the queued output as the caller's terminal takes now."""
        try:
            self._to_caller = self._to_caller[os.write(self.output, self._to_caller):]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # the caller's terminal is gone: the tool's output with it
            self.dropped += len(self._to_caller)
            self._to_caller = b""

    def _drain(self) -> None:
        """What the tool wrote before it exited and the thread has not copied, while the
        caller's terminal takes some of it at least every :data:`GRACE` seconds."""
        while self.master >= 0:
            if not self._to_caller:
                try:
                    data = os.read(self.master, _CHUNK)
                except OSError:  # nothing more now (EAGAIN), or hung up (EIO)
                    break
                if not data:
                    break
                self._to_caller = data
            poller = select.poll()
            poller.register(self.output, select.POLLOUT)
            if not poller.poll(int(GRACE * 1000)):
                break
            self._write_out()
        self.dropped += len(self._to_caller)
        self._to_caller = b""

    def _to_pty(self, data: bytes) -> int:
        try:
            return os.write(self.master, data) if data else 0
        except BlockingIOError:
            return 0
        except OSError:  # EIO: nobody on the other side any more
            return len(data)

    def _read_input(self) -> Optional[bytes]:
        """What the caller typed; b"" if another reader took it first, None at the end."""
        try:
            data = os.read(self.input, _CHUNK)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:
            return None
        return data or None
