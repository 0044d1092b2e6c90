"""Fault injection for transfer tests: a tcp proxy whose link dies after N bytes, a silent peer."""

from __future__ import annotations

import contextlib
import socket
import threading


class FlakyProxy:
    """Forwards 127.0.0.1:<port> to ``target``; after ``fail_after`` bytes have flowed back from
    the target (over all connections) it drops every connection and stops listening, like a NIC
    going down mid-transfer. ``close()`` stops all its threads."""

    def __init__(self, target: tuple[str, int], fail_after: int | None) -> None:
        self._target = target
        self._fail_after = fail_after
        self._forwarded = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address: tuple[str, int] = self._listener.getsockname()
        self.failed = threading.Event()
        self._spawn(self._accept_loop)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                if self.failed.is_set():
                    client.close()
                    upstream.close()
                    return
                self._socks += [client, upstream]
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        buffer = bytearray(1 << 16)
        try:
            while True:
                n = src.recv_into(buffer)
                if n == 0:
                    break
                dst.sendall(memoryview(buffer)[:n])
                if counted and self._fail_after is not None:
                    with self._lock:
                        self._forwarded += n
                        trip = self._forwarded >= self._fail_after
                    if trip:
                        self.kill()
                        return
        except OSError:
            pass
        finally:
            _shutdown(dst)

    def kill(self) -> None:
        """Drop every connection and the listener (connects are then refused)."""
        self.failed.set()
        _shutdown(self._listener)
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            _shutdown(sock)

    def close(self) -> None:
        self.kill()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        with self._lock:
            for sock in self._socks:
                sock.close()


class SilentPeer:
    """Accepts connections and never answers (a hung peer)."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.address: tuple[str, int] = self._listener.getsockname()

    @property
    def peer(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        self._listener.close()


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
