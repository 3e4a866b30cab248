"""The engine worker: ProcessAsyncEngine's child process, owning the Engine and its step loop.

The worker is a `Front` of the engine's `StepDriver` (rollout/engine/driver.py): each turn of the
driver runs the commands the parent sent since the last turn (request adds, aborts, pauses, RL methods)
and one `Engine.step`; the driver owns the requests in flight, the pause modes, the stalled state and
abort-all, and the worker only receives commands and delivers what they and the steps produce.

What the turns produce (the answers, the whole outputs of the requests that ended, the new token ids /
logprobs / weight versions of every streamed request) goes back as one `wire.Update` at a time: a small
one written at once where the socket has room, others by a thread of its own, so a step never waits for
the pipe. The next update goes once the parent says (ACK) that its callers have taken the last one;
until then the turns' results gather into it, so a parent that falls behind (many clients' SSE and JSON)
gets fewer, larger updates, and both processes do less work per token, instead of the device slowing
down. Answers to commands do not wait for the ACK. The HTTP work, the text work for streams and the JSON
stay in the parent.

More parents may attach (`listen`; several HTTP server processes over one engine): each has its own
link (pipe, sender, update), gets the outputs of the requests it added and the answers to its
commands; aborts, pauses and RL methods act on the one engine whoever sends them. The worker ends with
the parent that started it; another parent's close or death aborts only its own requests.

Requests are added with stream=False, so `step` builds outputs only for the requests that end (the work
`Engine.generate` does too); the tokens of streamed requests are read with `Engine.token_deltas` when
an update is handed to the sender, not on every step.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Hashable
from multiprocessing import connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from rollout.engine.driver import StepDriver
from rollout.outputs import RequestOutput
from rollout.process.child import engine_facts
from rollout.process.engine_process import handle_call
from rollout.process.wire import CLOSE, Call, Reply, Update, error_reply

log = logging.getLogger("rollout")

# the commands the worker runs itself; any other name is an Engine method or a property read
ADD, ABORT, ABORT_ALL, PAUSE, CONTINUE, LISTEN = "add", "abort", "abort_all", "pause", "continue", "listen"
ACK = "ack"  # the parent's callers took the last update: the next may go (no answer)
# an update this small is written by the step loop itself when the socket has room for it: the write
# then cannot wait for the parent, and the interpreter lock does not go to the sender thread and back,
# which costs a host-bound step more than the write (a Unix socket polls writable while at most a quarter
# of its send buffer, about 200 kB, is unread)
DIRECT_BYTES = 32 * 1024


def run(conn: Any, engine: Any) -> None:
    """The child's loop (the `loop` of process.serve_child)."""
    # SIGTERM is the parent's to handle too: a server stopping gracefully still needs its engine, and
    # the worker exits when the parent closes the pipe (or dies)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _Worker(conn, engine).loop()


class _Link:
    """One parent's connection: the update gathering for it and the thread that sends it. The first
    link is the parent that started the worker (its close or death ends the worker); others attached
    through `listen` (more HTTP server processes) and may come and go."""

    def __init__(self, conn: Any, primary: bool):
        self.conn, self.primary = conn, primary
        self.update = Update()  # what the turns since the last hand-over produced for this parent
        self.sender = _Sender(conn)
        self.acked = True  # the parent took the last update: the next may be handed over

    def ready(self, wait: bool) -> bool:
        """Whether this link's update may be handed over now: the parent acknowledged the last one (or
        this one holds answers, which never wait for it), and the sender is free (with `wait`, after
        the send in progress)."""
        return bool(self.acked or self.update.replies or self.update.failed) and self.sender.free(wait)


class _Owner:
    """Whose a request in flight is (the driver's owner of it): the parent that added it, and for a
    streamed one the output tokens already sent, per sample (None: not streamed)."""

    __slots__ = ("link", "sent")

    def __init__(self, link: _Link, sent: list[int] | None):
        self.link, self.sent = link, sent


class _Worker:
    def __init__(self, conn: Any, engine: Any):
        self.engine = engine
        self.driver = StepDriver(engine, self)
        self.links = [_Link(conn, primary=True)]
        self.closing = False  # the first parent said to close
        self.listener: connection.Listener | None = None
        self._key = os.urandom(32)  # what an attaching parent must know
        self._closing = False  # the listener is being closed: its accept errors end the accepting
        self._accepted: list[Any] = []  # connections the accepting thread took, not yet links
        self._accepted_lock = threading.Lock()
        self._wake_r, self._wake_w = connection.Pipe(duplex=False)  # wakes an idle turn for them

    def loop(self) -> None:
        try:
            self.driver.run()
            if self.closing:
                self.driver.close()  # callers get the outputs they have, acknowledged or not
                self._hand_over(wait=True, closing=True)
        finally:
            for link in self.links:  # what was handed over still goes, before the engine shuts down
                link.sender.close()
            if self.listener is not None:
                self._closing = True
                self.listener.close()

    # -- the driver's front -----------------------------------------------------------------------
    def poll(self, block: bool) -> bool | None:
        """Hand over what the last turn produced, then run the commands waiting (blocking for the first
        one when the driver is idle). None when the first parent has gone or says to close."""
        # nothing may wait in the worker while it sleeps, but what waits for an ACK (which wakes it)
        if not self._hand_over(wait=block):
            return None
        calls = self._receive(block=block)
        if calls is None:
            return None  # the first parent went away
        if not self._run_all(calls):
            self.closing = True
            return None
        return bool(calls)

    def deliver(self, items: list[tuple[_Owner | None, RequestOutput]]) -> None:
        first = self.links[0]
        for owner, out in items:
            (first if owner is None else owner.link).update.finished.append(out)

    def failed(self, error: Exception, ended: list[tuple[Hashable, _Owner]]) -> None:
        log.error("step failed", exc_info=error)
        for rid, owner in ended:  # the requests the failed step aborted: their callers get its error
            owner.link.update.failed.append(rid)
            owner.link.update.error = error_reply(0, error)

    # -- commands ---------------------------------------------------------------------------------
    def _receive(self, block: bool) -> list[tuple[_Link, Call]] | None:
        """Every batch of commands waiting on any link (blocking for the first one when idle); None
        when the first parent has gone."""
        self._adopt()
        by_conn = {link.conn: link for link in self.links}
        ready = connection.wait([*by_conn, self._wake_r], None if block else 0)
        calls: list[tuple[_Link, Call]] = []
        for conn in ready:
            if conn is self._wake_r:
                self._wake_r.recv()
                continue
            link = by_conn[conn]
            try:
                while conn.poll(0):
                    for call in conn.recv():
                        if call.method == ACK:
                            link.acked = True
                        else:
                            calls.append((link, call))
            except (EOFError, OSError):
                if link.primary:
                    return None
                self._drop(link)
        return calls

    def _run_all(self, calls: list[tuple[_Link, Call]]) -> bool:
        """Run the commands in order; False when the first parent says to close."""
        for link, call in calls:
            if call.method == CLOSE:
                if link.primary:
                    return False
                self._detach(link)
                continue
            link.update.replies.append(self._run(link, call))
        return True

    def _run(self, link: _Link, call: Call) -> Reply:
        try:
            if call.method == ADD:
                return Reply(call.id, True, self._add(link, *call.args))
            if call.method == ABORT:
                return Reply(call.id, True, self.driver.abort(call.args[0]))
            if call.method == ABORT_ALL:
                return Reply(call.id, True, self.driver.abort_all())
            if call.method == PAUSE:
                return Reply(call.id, True, self.driver.pause(call.args[0]))
            if call.method == CONTINUE:
                return Reply(call.id, True, self.driver.resume())
            if call.method == LISTEN:
                return Reply(call.id, True, self._listen())
        except BaseException as e:
            return error_reply(call.id, e)
        # RL methods and property reads, as EngineProcess runs them (the driver aborts first for abort=True)
        return handle_call(self.engine, call, self.driver.call)

    def _add(self, link: _Link, rid: Hashable, input_ids: Any, params: Any, stream: bool) -> None:
        sent = [0] * (1 if params is None else params.n) if stream else None
        self.driver.add(rid, input_ids, params, _Owner(link, sent))  # stream=False: see the docstring

    def _abort_all(self, link: _Link) -> int:
        """Abort the requests in flight that `link`'s parent added."""
        return self.driver.abort_all(lambda owner: owner.link is link)

    # -- more parents -----------------------------------------------------------------------------
    def _listen(self) -> tuple[str, bytes]:
        """Accept more parents (ProcessAsyncEngine.attach) on a Unix socket of this host; returns its
        address and key."""
        if self.listener is None:
            self.listener = connection.Listener(family="AF_UNIX", authkey=self._key)
            facts = engine_facts(self.engine)  # read here, between steps, not in the accepting thread
            accept = threading.Thread(target=self._accept_loop, args=(facts,), name="rollout-worker-accept")
            accept.daemon = True
            accept.start()
        return self.listener.address, self._key

    def _accept_loop(self, facts: dict) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, connection.AuthenticationError) as e:
                if self._closing:
                    return
                # a wrong key, or a client gone during the handshake: the next one may be fine
                log.warning("a connection to the engine worker failed: %s", e or type(e).__name__)
                continue
            try:
                conn.send(Reply(0, True, facts))
            except OSError:
                continue
            with self._accepted_lock:
                self._accepted.append(conn)
            self._wake_w.send(None)

    def _adopt(self) -> None:
        with self._accepted_lock:
            conns, self._accepted = self._accepted, []
        self.links += [_Link(conn, primary=False) for conn in conns]

    def _detach(self, link: _Link) -> None:
        """A parent that closes: its requests end as aborted, it gets their outputs, the link goes."""
        self._abort_all(link)
        if link.sender.free(wait=True):
            self._hand_over_to([link])
        self._drop(link)

    def _drop(self, link: _Link) -> None:
        """Forget a parent (gone, or detached): abort what it still has in flight."""
        self._abort_all(link)
        self.links.remove(link)
        link.sender.close()
        link.conn.close()

    # -- updates ----------------------------------------------------------------------------------
    def _hand_over(self, wait: bool, closing: bool = False) -> bool:
        """Give each parent's gathered update to its sender where the link is ready (see `_Link.ready`;
        when `closing`, only the sender counts); otherwise keep gathering. False when the first parent
        has gone. An idle turn that leaves an update waiting for its ACK sleeps until the ACK comes."""
        for link in self.links[1:]:
            if link.sender.broken:
                self._drop(link)
        if self.links[0].sender.broken:
            return False
        ready = [link for link in self.links if (link.sender.free(wait) if closing else link.ready(wait))]
        self._hand_over_to(ready)
        return not self.links[0].sender.broken

    def _hand_over_to(self, links: list[_Link]) -> None:
        """Hand `links` (their senders free) their updates, with the tokens their streamed requests
        gained since the last one."""
        if not links:
            return
        owners = self.driver.owners
        streamed = {
            rid: owner.sent for rid, owner in owners.items() if owner.sent is not None and owner.link in links
        }
        if streamed:
            for d in self.engine.token_deltas(streamed):
                streamed[d.request_id][d.sample] += len(d.token_ids)
                owners[d.request_id].link.update.tokens.append(d)
        for link in links:
            if link.update:
                update, link.update = link.update, Update()
                link.acked = False
                link.sender.send(update)


class _Sender:
    """Sends one update at a time: pickled by the caller, then written at once when small (see
    DIRECT_BYTES), or by a thread of its own, whose writes may wait for the parent to read."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.broken = False  # a send failed: the parent has gone
        self._ready = threading.Condition()
        self._next: bytes | None = None  # an update handed over (pickled), not yet taken by the thread
        self._busy = False  # the thread is sending one
        self._closing = False
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLOUT)
        self._thread = threading.Thread(target=self._run, name="rollout-worker-send", daemon=True)
        self._thread.start()

    def free(self, wait: bool) -> bool:
        """Whether nothing is in hand; with `wait`, after waiting for that."""
        with self._ready:
            if wait:
                self._ready.wait_for(lambda: self.broken or (self._next is None and not self._busy))
            return self._next is None and not self._busy

    def send(self, update: Update) -> None:
        """Send `update` (the sender free): small ones at once, larger ones from the thread."""
        buf = ForkingPickler.dumps(update)  # as conn.send pickles
        if len(buf) > DIRECT_BYTES or not self._poll.poll(0):
            with self._ready:
                assert self._next is None, "the sender has an update in hand"
                self._next = buf
                self._ready.notify_all()
            return
        try:
            self.conn.send_bytes(buf)
        except (OSError, EOFError, ValueError):
            self.broken = True

    def close(self) -> None:
        """Send what is in hand, then stop the thread."""
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next is not None or self._closing)
                if self._next is None:
                    return  # closing, nothing left
                buf, self._next, self._busy = self._next, None, True
            try:
                self.conn.send_bytes(buf)
            except (OSError, EOFError, ValueError):
                self.broken = True
            with self._ready:
                self._busy = False
                self._ready.notify_all()
            if self.broken:
                return
