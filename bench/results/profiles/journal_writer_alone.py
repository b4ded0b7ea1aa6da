"""The journal's writer thread alone: CPU per write with nothing else in the process.

``python bench/results/profiles/journal_writer_alone.py`` posts 3,000 records of 8 one-token
runs (the served shape: one record per engine step of 8 requests) to a ``Journal`` with a
listener, one every 2 ms from one thread, each with 8 conditions on one lock to notify as
the router's ``_written`` does, and prints the writer thread's CPU per write and the
poster's per post. Set beside ``router_threads_show.py``'s figure for the writer in the
stack (docs/serving.md): the difference is what the stack's other threads add.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

from reference_impl.serving.journal import Journal, token_runs_record

RECORDS = 3000


def thread_cpu_s(thread: threading.Thread) -> float:
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    folder = tempfile.mkdtemp(prefix="journal-writer-")
    journal = Journal(os.path.join(folder, "journal"), fsync_interval=0.05)
    lock = threading.Lock()
    conditions = [threading.Condition(lock) for _ in range(8)]
    batches = [0]

    def written(marks: list[tuple[object, int]]) -> None:
        with lock:
            for mark, _offset in marks:
                for condition in mark:  # type: ignore[attr-defined]
                    condition.notify_all()
        batches[0] += 1

    journal.listen(written)
    writer = next(t for t in threading.enumerate() if t.name == "journal-writer")
    runs = [(f"cmpl-{i:032x}", 17, [65], ["0123456789abcdef"]) for i in range(8)]
    writer_before, poster_before = thread_cpu_s(writer), time.thread_time()
    for _ in range(RECORDS):
        with lock:
            journal.post(token_runs_record(runs), conditions)
        time.sleep(0.002)
    poster = time.thread_time() - poster_before
    time.sleep(0.2)
    writes = journal.stats().writes
    print(f"writer: {(thread_cpu_s(writer) - writer_before) / batches[0] * 1e6:.0f} µs of CPU "
          f"per write ({journal.stats().records / writes:.2f} records a write); poster: "
          f"{poster / RECORDS * 1e6:.0f} µs per post")
    journal.close()


if __name__ == "__main__":
    main()
