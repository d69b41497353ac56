"""A host model of the fused backward's dQ protocol (landed from the fused-bulk-dq candidate, 2026-12-07)
(ferro_dq_order.cuh's stage_dq and write_dq_in_order), under random interleavings.

Agents per block (key block n of one (batch, head)): two computing warpgroups, which meet at a
barrier every step (computing_sync) and stage the step's dQ partial in turn (step t: warpgroup
t % 2, its own buffer), and the writer warp, which takes the steps in order: waits for the
staging (dq_full), for the tile's counter to read its rank, issues the bulk add, hands the buffer
back once the add has read it (dq_empty), and counts the add once it has landed. A bulk add's
read of shared memory and its landing in global memory are separate events, each at a random
later time. Blocks start in index order, at most SMS at once (one block an SM).

Checks: no deadlock; a buffer is neither staged over before the writer has read its previous
use nor read before its staging is complete; every tile's adds land in key-block order, each
exactly once.
Variants: "ok" (the kernel: each block walks its query tiles from the first up), "walk_down" (the
fused-walk-down candidate: from the last down), and bugs each check must catch: "early_empty" (the buffer handed
back at issue, before the read), "no_empty_wait" (staging without waiting for dq_empty),
"count_at_issue" (the counter counted when the add is issued, not when it has landed),
"no_order" (no wait on the counter).

    python3 lab/models/dq_model.py [SEEDS] [VARIANT,...]
"""
import random
import sys


class Bar:  # an mbarrier: phases by parity, as try_wait.parity sees them
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self, use_phase):
        assert use_phase == self.phase, f"arrival for phase {use_phase} lands in phase {self.phase}"
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def done(self, parity):
        return (self.phase & 1) != parity


class Sim:
    def __init__(self, seed, variant, blocks=6, tiles=5, sms=3):
        self.r = random.Random(seed)
        self.variant, self.blocks, self.sms = variant, blocks, sms
        # Which tiles each key block visits: a random window that keeps each tile's visitors
        # consecutive (as first_key_block requires: tests/test_dq_order_on_host.py).
        lo = sorted(self.r.randrange(tiles) for _ in range(blocks))  # causal-like: starts rise
        self.visits = [list(range(lo[n], tiles)) for n in range(blocks)]
        self.first = {i: min(n for n in range(blocks) if i in self.visits[n]) for i in range(tiles)
                      if any(i in v for v in self.visits)}
        self.sem = {i: 0 for i in self.first}
        self.landed = {i: [] for i in self.first}
        self.started, self.running = 0, []
        self.sem_waits = 0
        self.agents = []

    def wait(self, cond):
        while not cond():
            yield

    def block(self, n):
        steps = self.visits[n][::-1] if self.variant == "walk_down" else self.visits[n]
        full, empty = [Bar(128), Bar(128)], [Bar(1), Bar(1)]
        staged = [None, None]  # buffer -> ("staging" | "staged" | "read", step)
        sync = [0, 0]  # computing_sync: steps each warpgroup has reached
        inflight = []  # bulk adds issued and not yet landed: (tile, rank)

        def computing(g):
            uses = 0
            for t, i in enumerate(steps):
                sync[g] = t + 1
                yield from self.wait(lambda: min(sync) >= t + 1)
                if t % 2 != g:
                    continue
                if uses > 0 and self.variant != "no_empty_wait":
                    yield from self.wait(lambda: empty[g].done((uses - 1) & 1))
                st = staged[g]
                assert st is None or st[0] == "read", f"block {n} wg {g} stages step {t} over {st}"
                staged[g] = ("staging", t)
                yield
                staged[g] = ("staged", t)
                for _ in range(128):
                    full[g].arrive(uses)
                uses += 1

        def writer():
            uses = [0, 0]
            for t, i in enumerate(steps):
                buf = t % 2
                use = uses[buf]
                uses[buf] += 1
                yield from self.wait(lambda: full[buf].done(use & 1))
                assert staged[buf] == ("staged", t), f"block {n} writer reads {staged[buf]} for step {t}"
                rank = n - self.first[i]
                if self.variant != "no_order":
                    while self.sem[i] != rank:
                        self.sem_waits += 1  # scheduler turns spent waiting for the order
                        yield
                if self.variant == "early_empty":
                    empty[buf].arrive(use)
                yield  # the bulk read in flight
                while self.r.random() < 0.5:
                    assert staged[buf] == ("staged", t), f"block {n}: buffer {buf} staged over mid-read"
                    yield
                assert staged[buf] == ("staged", t), f"block {n}: buffer {buf} staged over mid-read"
                staged[buf] = ("read", t)
                if self.variant != "early_empty":
                    empty[buf].arrive(use)
                inflight.append((i, n))
                if self.variant == "count_at_issue":
                    self.sem[i] += 1
                yield from self.wait(lambda: (i, n) not in inflight)  # wait_group 0
                if self.variant != "count_at_issue":
                    self.sem[i] += 1

        def lander():  # the L2: each issued add lands some time later
            while True:
                if inflight and self.r.random() < 0.4:
                    i, m = inflight.pop(self.r.randrange(len(inflight)))
                    self.landed[i].append(m)
                yield

        return [computing(0), computing(1), writer()], lander()

    def run(self, limit=20000):
        landers = []
        for _ in range(limit):
            self.running = [b for b in self.running if b]
            while self.started < self.blocks and len(self.running) < self.sms:
                agents, lander = self.block(self.started)
                self.running.append(agents)
                landers.append(lander)
                self.started += 1
            if not self.running:
                break
            progressed = False
            for lander in landers:
                next(lander)
            order = [(b, a) for b in self.running for a in b]
            self.r.shuffle(order)
            for b, a in order[: 1 + self.r.randrange(len(order))]:
                try:
                    next(a)
                    progressed = True
                except StopIteration:
                    b.remove(a)
                    progressed = True
            if not progressed:
                break
        else:
            raise AssertionError("deadlock (no end within the step limit)")
        assert self.started == self.blocks and not any(self.running), "deadlock"
        for lander in landers:  # let the last adds land
            for _ in range(200):
                next(lander)
        for i, ms in self.landed.items():
            want = [n for n in range(self.blocks) if i in self.visits[n]]
            assert ms == want, f"tile {i}: adds landed in order {ms}, want {want}"


def main():
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    variants = (sys.argv[2].split(",") if len(sys.argv) > 2 else
                ["ok", "walk_down", "early_empty", "no_empty_wait", "count_at_issue", "no_order"])
    for v in variants:
        fails, waits = 0, 0
        first = None
        for seed in range(seeds):
            sim = Sim(seed, v, blocks=2 + seed % 6, tiles=2 + seed % 5, sms=1 + seed % 4)
            try:
                sim.run()
            except AssertionError as e:
                fails += 1
                first = first or f"seed {seed}: {e}"
            waits += sim.sem_waits
        print(f"{v:15s} {fails:4d} of {seeds} seeds fail; {waits / seeds:6.1f} turns a seed waiting "
              "for the order" + (f"  (first: {first})" if first else ""))


if __name__ == "__main__":
    main()
