"""A metadata replica's main thread stops on a signal that another thread received."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The replica's main loop (`_install_handlers`, `wait_for_stop`) in a child of its own; a
# helper thread sends SIGTERM to itself, so the kernel delivers it to that thread and Python
# runs the handler only when the main thread next runs bytecode. A main thread blocked in a
# plain `Event.wait()` never does (the old loop; seen in a loaded run as a replica that
# ignored SIGTERM for 20 s). The child's own deadline says which happened.
CHILD = textwrap.dedent(
    """
    import signal, threading, time
    from kvflow.tools.meta import _install_handlers, wait_for_stop

    stop = threading.Event()
    _install_handlers(stop)
    sent = threading.Event()

    def kill_self():
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        sent.set()
        time.sleep(120)  # alive: the signal stays with this thread

    threading.Thread(target=kill_self, daemon=True).start()
    sent.wait(60)
    wait_for_stop(stop)
    print("stopped")
    """
)


def test_a_signal_on_another_thread_stops_the_replica():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
