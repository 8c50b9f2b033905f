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
  group): the caller's terminal is put in raw mode for the run and the pty gets its
  settings, so editors and REPLs work and Ctrl-C reaches the tool through the pty.
  The pty's suspend character starts disabled: a stopped tool with the terminal raw
  could be ended only by its timeout.
- Otherwise (a pipeline, a background job) the caller's terminal is left as it is:
  its own line discipline echoes and edits, its Ctrl-C reaches the launcher (which
  forwards it); the pty echoes nothing and passes output unchanged. Input is read
  only when stdin is a terminal and the launcher is in its foreground group (a
  background run does not take the shell's input).

The settings the caller's terminal had are put back when the run ends; its size is
copied to the pty at the start and on each SIGWINCH (:meth:`Relay.resize`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import termios
import threading
from typing import Any, Optional, Sequence

from ..linux.process import is_terminal

#: termios(3)'s index of the local modes and of the control characters in tcgetattr's list.
_LFLAG, _OFLAG, _CC = 3, 1, 6
#: Echo flags cleared on a non-interactive pty: the caller's terminal echoed the input.
_ECHOES = termios.ECHO | termios.ECHOE | termios.ECHOK | termios.ECHONL
#: _POSIX_VDISABLE on Linux: a control character that never matches.
_DISABLED = b"\0"
#: The most bytes read at once from either side.
_CHUNK = 65536


def _in_front(fd: int) -> bool:
    """Whether this process may read terminal ``fd`` without job control stopping it: its
    group is in front, or the terminal is not its controlling terminal (no job control)."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return True


class Relay:
    """The tool's pty and the thread that copies between it and the caller's terminal.

    Made when a terminal is among ``stdio``: what the tool would get as its
    stdin, stdout and stderr. :meth:`replace` gives it the pty's slave in place of each
    terminal; :attr:`slave` is its controlling terminal where the executor makes it one
    (``sandlock run``). :meth:`start` once the tool is forked; :meth:`close` once it has
    exited (the output it left is copied first). ``interactive``: the caller's terminal
    may be put in raw mode (``sandlock run``, never a library's caller)."""

    def __init__(self, stdio: Sequence[int], *, interactive: bool) -> None:
        terminals = [fd >= 0 and is_terminal(fd) for fd in stdio]
        self.input = stdio[0] if terminals[0] and _in_front(stdio[0]) else -1
        self.output = next((stdio[i] for i in (1, 2) if terminals[i]), -1)
        self.interactive = (interactive and self.input >= 0 and terminals[1]
                            and os.fstat(stdio[0]).st_rdev == os.fstat(stdio[1]).st_rdev)
        reference = self.output if self.output >= 0 else stdio[terminals.index(True)]
        self._terminals = terminals
        self.caller_mode: Optional[list[Any]] = None
        self.master, self.slave = os.openpty()
        try:
            mode = termios.tcgetattr(reference)
            if self.interactive:
                mode[_CC][termios.VSUSP] = _DISABLED
            else:
                mode[_LFLAG] &= ~_ECHOES
                mode[_OFLAG] &= ~termios.OPOST
            termios.tcsetattr(self.slave, termios.TCSANOW, mode)
            self.resize()
            os.set_blocking(self.master, False)
            self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            os.close(self.master)
            os.close(self.slave)
            raise
        self._thread: Optional[threading.Thread] = None

    def replace(self, stdio: Sequence[int]) -> tuple[int, int, int]:
        """``stdio`` with the pty's slave in place of each terminal."""
        a, b, c = (self.slave if tty else fd for fd, tty in zip(stdio, self._terminals))
        return a, b, c

    def resize(self) -> None:
        """The caller's terminal's size, given to the pty (whose line discipline then
        sends the tool's group SIGWINCH)."""
        source = self.output if self.output >= 0 else self.input
        try:
            size = fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.master, termios.TIOCSWINSZ, size)
        except OSError:
            pass

    def start(self) -> None:
        """After the fork: the launcher's copy of the slave closed, the caller's terminal
        raw if interactive, the copying thread started."""
        os.close(self.slave)
        self.slave = -1
        if self.interactive:
            self.caller_mode = termios.tcgetattr(self.input)
            raw = termios.tcgetattr(self.input)
            raw[0] &= ~(termios.BRKINT | termios.ICRNL | termios.INPCK | termios.ISTRIP
                        | termios.IXON)
            raw[_OFLAG] &= ~termios.OPOST
            raw[2] = (raw[2] & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
            raw[_LFLAG] &= ~(termios.ECHO | termios.ICANON | termios.IEXTEN | termios.ISIG)
            raw[_CC][termios.VMIN] = 1
            raw[_CC][termios.VTIME] = 0
            termios.tcsetattr(self.input, termios.TCSADRAIN, raw)
        self._thread = threading.Thread(target=self._copy, name="sandlock-terminal",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Once the tool has exited: the output it left copied, the thread ended, the
        caller's terminal as it was, the pty closed."""
        try:
            if self._thread is not None:
                os.write(self._stop_w, b"x")
                self._thread.join()
            self._drain()
        finally:
            if self.caller_mode is not None:
                try:
                    termios.tcsetattr(self.input, termios.TCSADRAIN, self.caller_mode)
                except OSError:
                    pass
            for fd in (self.master, self.slave, self._stop_r, self._stop_w):
                if fd >= 0:
                    os.close(fd)
            self.master = self.slave = self._stop_r = self._stop_w = -1

    def _copy(self) -> None:
        """The thread: pty output to the caller's terminal, the caller's input to the
        pty, until :meth:`close` says stop or the pty hangs up."""
        poller = select.poll()
        poller.register(self._stop_r, select.POLLIN)
        poller.register(self.master, select.POLLIN)
        if self.input >= 0:
            poller.register(self.input, select.POLLIN)
        pending = b""  # input the pty has not taken yet (its input queue is full)
        while True:
            events = dict(poller.poll())
            if self._stop_r in events:
                return
            if self.master in events:
                if events[self.master] & select.POLLOUT and pending:
                    pending = pending[self._to_pty(pending):]
                if events[self.master] & select.POLLIN and not self._from_pty():
                    return
                if events[self.master] & (select.POLLHUP | select.POLLERR) \
                        and not events[self.master] & select.POLLIN:
                    return
            if events.get(self.input, 0) and not pending:
                data = self._read(self.input)
                if data is None:  # the caller's terminal is gone, or at its end of input
                    poller.unregister(self.input)
                    data = self._end_of_input()
                pending = data[self._to_pty(data):]
            poller.modify(self.master, select.POLLIN | (select.POLLOUT if pending else 0))

    def _from_pty(self) -> bool:
        """Copy what the pty has to the caller's terminal; False once it is hung up."""
        try:
            data = os.read(self.master, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:  # EIO: every slave closed
            return False
        if not data:
            return False
        self._out(data)
        return True

    def _drain(self) -> None:
        """What the tool wrote before it exited and the thread has not copied."""
        while self.master >= 0:
            try:
                data = os.read(self.master, _CHUNK)
            except OSError:
                return
            if not data:
                return
            self._out(data)

    def _out(self, data: bytes) -> None:
        if self.output < 0:
            return  # no terminal to show it on: a pty with stdin only echoes nothing
        while data:
            try:
                data = data[os.write(self.output, data):]
            except InterruptedError:
                continue
            except OSError:
                return  # the caller's terminal is gone: the tool's output with it

    def _to_pty(self, data: bytes) -> int:
        try:
            return os.write(self.master, data) if data else 0
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno == errno.EIO:
                return len(data)  # nobody on the other side any more
            raise

    @staticmethod
    def _read(fd: int) -> Optional[bytes]:
        try:
            data = os.read(fd, _CHUNK)
        except OSError:
            return None
        return data or None

    def _end_of_input(self) -> bytes:
        """The caller's end of input (Ctrl-D on its cooked terminal), passed on as the
        pty's own end-of-file character while the pty is canonical."""
        if self.interactive:
            return b""
        try:
            mode = termios.tcgetattr(self.master)  # a master's termios are its slave's
        except OSError:
            return b""
        if not mode[_LFLAG] & termios.ICANON:
            return b""
        eof = mode[_CC][termios.VEOF]
        return eof if isinstance(eof, bytes) and eof != _DISABLED else b""
