"""A small multi-rank tour of asyncreduce: run it with ``asyncreduce run -n 4 examples/hello.py``.

Every rank posts a few non-blocking operations from several threads, computes while they
run, then waits and checks the results against what they must be.
"""

from __future__ import annotations

import threading
import time

import numpy as np

import asyncreduce as ar


def main() -> None:
    with ar.init() as comm:
        rank, n = comm.rank, comm.world_size
        sizes = [250_000 * (i + 1) for i in range(4)]
        value = float(rank + 1)
        grads = {f"layer{i}.grad": np.full(s, value, np.float32) for i, s in enumerate(sizes)}

        # Post every allreduce at once, each from its own thread, in a different order per rank.
        requests: dict[str, ar.Request[np.ndarray]] = {}
        names = sorted(grads, key=lambda k: hash((k, rank)))

        def post(name: str) -> None:
            requests[name] = comm.iallreduce(grads[name], op="avg", name=name)

        threads = [threading.Thread(target=post, args=(name,)) for name in names]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        posted = time.perf_counter() - start

        busy = np.random.default_rng(rank).standard_normal((300, 300)).astype(np.float32)
        for _ in range(20):  # compute while the allreduces run in the background
            busy = np.tanh(busy @ busy.T / 300)

        ar.wait_all(list(requests.values()), timeout=60)
        total = time.perf_counter() - start
        expected = sum(range(1, n + 1)) / n
        assert all(np.allclose(g, expected) for g in grads.values())
        mib = sum(g.nbytes for g in grads.values()) / 2**20
        gathered = comm.allgather(np.array([total * 1e3], np.float64))
        print(
            f"rank {rank}/{n}: averaged {len(grads)} gradients ({mib:.1f} MiB) posted from "
            f"{len(threads)} threads in {posted * 1e3:.1f} ms; done after {total * 1e3:.0f} ms "
            f"(slowest rank {gathered.max():.0f} ms); every value = {expected:g} as expected"
        )


if __name__ == "__main__":
    main()
