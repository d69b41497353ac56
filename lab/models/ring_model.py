"""A host model of flash_fwd_wgmma.cu's barrier protocol, (landed from the kv-split-barriers candidate, 2026-12-07):
the loading warpgroup, the computing warpgroups (each its own key range [t_lo, t_hi), tiles
outside it passed over) and the persistent item loop (tile_ready, q_full / q_empty), under random
interleavings. Checks: no deadlock; every arrival lands in the phase it is meant for; no buffer is
overwritten while a product reads it, nor read before its copy has landed. Agents: the loaders as
2 (thread 0, which publishes the items, and the rest), each computing warpgroup as 2 (its warps
drift apart); a product reads from issue to its wgmma wait; cp.async copies and their
mbarrier arrivals land later, in issue order per agent (cp.async.mbarrier.arrive counts every
earlier copy of the thread). Mbarriers are modelled by phase and parity, as try_wait.parity sees
them. Variants: "old" (main: one full / empty pair, STAGES >= 2; at 1 it deadlocks), "split"
(the candidate: K(t), V(t)), "vlag" (kv-split-barriers-vlag.patch: K(t), V(t - 1)), and bugs
each check must catch (early K or V release, no V pass-over, vlag without the V wait).
"bug_no_v_wait" (split without the loop's V wait) passes, as it should: with K(t) loaded after
V(t - 1), full_k(t) completing implies V(t - 1) landed; the wait is kept for vlag's order.

    python3 lab/models/ring_model.py [SEEDS] [VARIANT,...]

2026-12-07: split, vlag and old 0 failures in 3000 seeds each; every bug variant caught in
68-76% of seeds (the rest never reach the interleaving)."""
import random, sys

class Bar:
    def __init__(s, name, count): s.name, s.count, s.pending, s.phase = name, count, count, 0
    def arrive(s, w, use_phase):
        assert use_phase == s.phase, f"{s.name}: arrival for phase {use_phase} lands in phase {s.phase}"
        s.pending -= w
        assert s.pending >= 0, f"{s.name}: too many arrivals in phase {s.phase}"
        if s.pending == 0: s.phase += 1; s.pending = s.count
    def phase_done(s, parity):  # try_wait.parity: the phase of this parity has completed
        return (s.phase & 1) != parity

class Sim:
    def __init__(s, seed, STAGES, QB, WGS, items, variant):
        s.r = random.Random(seed); s.S, s.QB, s.WGS, s.items, s.variant = STAGES, QB, WGS, items, variant
        CONS = 128 * WGS
        mk = lambda n, c: [Bar(f"{n}{i}", c) for i in range(max(STAGES, 1))]
        if variant == "old":
            s.full = mk("full", 128); s.empty = mk("empty", CONS)
        else:
            s.full_k = mk("full_k", 128); s.empty_k = mk("empty_k", CONS)
            s.full_v = mk("full_v", 128); s.empty_v = mk("empty_v", CONS)
        s.q_full = [Bar(f"q_full{i}", 128) for i in range(QB)]
        s.q_empty = [Bar(f"q_empty{i}", CONS) for i in range(QB)]
        s.tile_ready = [Bar(f"tile_ready{i}", 1) for i in range(QB)]
        s.slot = [None] * QB
        # buffers: (kind, index) -> landed use, pending use, active readers
        s.content, s.pendw, s.readers = {}, {}, {}
        s.inflight = {}  # agent -> list of (bar, w, phase, buffer writes)
    # ---- helpers (generators yield while blocked)
    def wait(s, bar, parity):
        while not bar.phase_done(parity): yield "blocked"
    def ring_wait_full(s, bars, n):
        yield from s.wait(bars[n % s.S], (n // s.S) & 1)
    def ring_wait_empty(s, bars, n):
        if n >= s.S: yield from s.wait(bars[n % s.S], ((n // s.S) - 1) & 1)
    def release(s, bars, n, w):
        bars[n % s.S].arrive(w, n // s.S)
    def qrelease(s, bars, n, w):
        bars[n % s.QB].arrive(w, n // s.QB)
    def write(s, agent, buf, use):  # cp.async issue: lands with the agent's next arrival
        assert not s.readers.get(buf), f"write of {buf} use {use} while read by {s.readers[buf]}"
        s.pendw[buf] = use
        s.inflight.setdefault(agent, []).append(("w", buf, use))
    def cp_arrive(s, agent, bar, w, ph):
        s.inflight.setdefault(agent, []).append(("a", bar, w, ph))
    def land_one(s, agent):
        q = s.inflight.get(agent)
        if not q: return False
        e = q.pop(0)
        if e[0] == "w": s.content[e[1]] = e[2]; s.pendw.pop(e[1], None) if s.pendw.get(e[1]) == e[2] else None
        else: e[1].arrive(e[2], e[3])
        return True
    def begin_read(s, who, buf, use):
        assert s.content.get(buf) == use and buf not in s.pendw, f"{who} reads {buf} use {use}: holds {s.content.get(buf)}, pending {s.pendw.get(buf)}"
        s.readers.setdefault(buf, set()).add(who)
    def end_read(s, who, buf, use):
        assert s.content.get(buf) == use and buf not in s.pendw, f"{who} end read {buf} use {use}"
        s.readers[buf].discard(who)
    # ---- programs
    def loader(s, me, w):
        ring, n = 0, 0
        while True:
            if n >= s.QB: yield from s.wait(s.q_empty[n % s.QB], ((n // s.QB) - 1) & 1)
            if me == 0:
                s.slot[n % s.QB] = n
                s.tile_ready[n % s.QB].arrive(1, n // s.QB)
            yield from s.wait(s.tile_ready[n % s.QB], (n // s.QB) & 1)
            x = s.slot[n % s.QB]; assert x == n
            if x >= len(s.items): break
            n_tiles = s.items[x][0]
            s.write((me,), ("Q", n % s.QB, me), n); s.cp_arrive((me,), s.q_full[n % s.QB], w, n // s.QB)
            if s.variant.startswith("vlag"):  # V one tile behind K: K(t), V(t - 1), ..., V(last)
                for t in range(n_tiles + 1):
                    if t < n_tiles:
                        u = ring + t
                        yield from s.ring_wait_empty(s.empty_k, u)
                        s.write((me,), ("K", u % s.S, me), u)
                        s.cp_arrive((me,), s.full_k[u % s.S], w, u // s.S)
                    if t > 0:
                        u = ring + t - 1
                        yield from s.ring_wait_empty(s.empty_v, u)
                        s.write((me,), ("V", u % s.S, me), u)
                        s.cp_arrive((me,), s.full_v[u % s.S], w, u // s.S)
                    yield
                ring += n_tiles
                n_tiles = 0
            for t in range(n_tiles):
                st = ring % s.S
                if s.variant == "old":
                    yield from s.ring_wait_empty(s.empty, ring)
                    s.write((me,), ("K", st, me), ring); s.write((me,), ("V", st, me), ring)
                    s.cp_arrive((me,), s.full[st], w, ring // s.S)
                else:
                    yield from s.ring_wait_empty(s.empty_k, ring)
                    s.write((me,), ("K", st, me), ring)
                    s.cp_arrive((me,), s.full_k[st], w, ring // s.S)
                    yield from s.ring_wait_empty(s.empty_v, ring)
                    s.write((me,), ("V", st, me), ring)
                    s.cp_arrive((me,), s.full_v[st], w, ring // s.S)
                ring += 1
                yield
            n += 1
    def consumer(s, wg, half, w):
        who = (wg, half); ring, n = 0, 0
        bufs = lambda kind, u: [(kind, u % s.S, l) for l in (0, 1)]  # both loader agents' parts
        qb = lambda n: [("Q", n % s.QB, l) for l in (0, 1)]
        def rd(kind, u, begin):
            for b in bufs(kind, u): (s.begin_read if begin else s.end_read)(who, b, u)
        def rq(n, begin):
            for b in qb(n): (s.begin_read if begin else s.end_read)(who, b, n)
        while True:
            yield from s.wait(s.tile_ready[n % s.QB], (n // s.QB) & 1)
            x = s.slot[n % s.QB]
            if x >= len(s.items): break
            n_tiles, ranges = s.items[x]
            t_lo, t_hi = ranges[wg]
            def pass_over(t):
                if s.variant == "old":
                    yield from s.ring_wait_full(s.full, ring + t); s.release(s.empty, ring + t, w)
                else:
                    yield from s.ring_wait_full(s.full_k, ring + t); s.release(s.empty_k, ring + t, w)
                    if s.variant != "bug_no_v_pass":
                        yield from s.ring_wait_full(s.full_v, ring + t)
                        s.release(s.empty_v, ring + t, w)
            for t in range(t_lo): yield from pass_over(t)
            yield from s.wait(s.q_full[n % s.QB], (n // s.QB) & 1)
            for t in range(t_lo, t_hi):
                u = ring + t
                if s.variant == "old":
                    yield from s.ring_wait_full(s.full, u)
                    rq(n, True); rd("K", u, True)
                    if t > t_lo: rd("V", u - 1, True)
                    yield
                    rq(n, False); rd("K", u, False)  # wgmma_wait<1>
                    yield  # softmax
                    if t > t_lo: rd("V", u - 1, False)
                    if t > t_lo: s.release(s.empty, u - 1, w)
                else:
                    yield from s.ring_wait_full(s.full_k, u)
                    rq(n, True); rd("K", u, True)
                    if t > t_lo:
                        if s.variant not in ("bug_no_v_wait", "vlag_no_v_wait"): yield from s.ring_wait_full(s.full_v, u - 1)
                        rd("V", u - 1, True)
                    yield
                    if s.variant == "bug_early_k":  # release K before S completes
                        s.release(s.empty_k, u, w); yield; rq(n, False); rd("K", u, False)
                    else:
                        rq(n, False); rd("K", u, False)  # wgmma_wait<1>
                        s.release(s.empty_k, u, w)
                    if t > t_lo and s.variant == "bug_early_v": s.release(s.empty_v, u - 1, w)
                    yield  # softmax
                    if t > t_lo: rd("V", u - 1, False)
                    if t > t_lo and s.variant != "bug_early_v": s.release(s.empty_v, u - 1, w)
                yield
            if t_hi > t_lo:
                u = ring + t_hi - 1
                if s.variant != "old": yield from s.ring_wait_full(s.full_v, u)
                rd("V", u, True); yield; rd("V", u, False)
                s.release(s.empty if s.variant == "old" else s.empty_v, u, w)
            s.qrelease(s.q_empty, n, w)
            for t in range(t_hi, n_tiles): yield from pass_over(t)
            ring += n_tiles; n += 1
    # hooks for a model built on this one (fwd-pingpong's turn_model.py)
    def program(s, wg, half, w): return s.consumer(wg, half, w)  # a computing half-warpgroup
    def final_checks(s): pass  # after a run that ended
    def run(s):
        agents = [("L", 0, s.loader(0, 64)), ("L", 1, s.loader(1, 64))]
        for wg in range(s.WGS):
            for h in (0, 1): agents.append(("C", (wg, h), s.program(wg, h, 64)))
        live = list(agents); steps = stuck = 0
        while live or any(s.inflight.values()):
            steps += 1
            landed = False
            for a in list(s.inflight):  # cp.async copies and their arrivals land at random
                if s.inflight[a] and s.r.random() < 0.3: landed |= s.land_one(a)
            if not live: continue
            a = s.r.choice(live)
            try:
                blocked = next(a[2]) == "blocked"
            except StopIteration:
                live.remove(a); blocked = False
            # deadlock: every live agent only spins in a wait, nothing left to land
            stuck = stuck + 1 if blocked and not landed and not any(s.inflight.values()) else 0
            if stuck > 100 * len(agents):
                raise AssertionError("deadlock: " + ", ".join(str(x[:2]) for x in live))
        s.final_checks()
        return steps

def check(variant, seeds, quiet=False):
    bad = 0
    for seed in range(seeds):
        r = random.Random(seed * 7919 + 1)
        S, QB, WGS = r.choice([2, 3, 4] if variant == "old" else [1, 2, 3, 4]), r.choice([1, 2]), r.choice([1, 2, 3])
        items = []
        for _ in range(r.randint(1, 6)):
            nt = r.randint(0, 6)
            ranges = []
            for _ in range(WGS):
                lo = r.randint(0, nt); hi = r.randint(lo, nt)
                if r.random() < 0.5: lo, hi = 0, nt
                ranges.append((lo, hi))
            items.append((nt, ranges))
        sim = Sim(seed, S, QB, WGS, items, variant)
        try:
            sim.run()
        except AssertionError as e:
            bad += 1
            if not quiet and bad <= 3: print(f"  {variant} seed {seed} S{S} QB{QB} WGS{WGS}: {e}")
    return bad

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    for v in (sys.argv[2].split(",") if len(sys.argv) > 2 else ("old", "split", "vlag", "bug_early_k", "bug_no_v_pass", "bug_no_v_wait", "vlag_no_v_wait", "bug_early_v")):
        print(v, "failures:", check(v, n), "of", n)
