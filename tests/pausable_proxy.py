"""PausableProxy: a TCP forwarder on 127.0.0.1 that can stop forwarding, in both directions,
without closing anything: to its clients the peer behind it looks SIGSTOPped (connections
stay open, nothing answers)."""

from __future__ import annotations

import contextlib
import socket
import threading


class PausableProxy:
    """``address`` forwards to ``target``; ``paused`` (an Event) holds every byte while set.
    ``close()`` stops it and closes every socket."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.paused = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    break
                while self.paused.is_set() and not self._closed.is_set():
                    self._closed.wait(0.01)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv (close does not)
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(2)
