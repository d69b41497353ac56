"""A host model of flash_fwd_wgmma.cu's barrier protocol with ping-pong turns, for the fwd-pingpong
candidate, built on lab/models/ring_model.py (imported: the loading warpgroup, the
K and V rings, the persistent item loop with tile_ready / q_full / q_empty, cp.async arrivals
landing late, computing warpgroups drifting apart, each with its own key range [t_lo, t_hi)),
plus the named barriers of the turns ("pp" variants). A named barrier is modelled as the
hardware counts it: a phase completes when 256 threads have arrived, by bar.sync (which then
waits for the phase to complete) or bar.arrive (which does not wait); each computing warpgroup
is 2 agents of 64 threads, so its warps do not sync or arrive together. Checks, besides
ring_model's (no deadlock; every mbarrier arrival in the phase it is meant for; no buffer
overwritten while read or read before it landed):
  - protocol: each phase of warpgroup g's turn barrier is made of g's own sync (128 threads)
    and its predecessor's arrive (128), no agent twice in one phase (an early second arrival
    would be one);
  - ping-pong: no two warpgroups inside a turn (from their sync's completion to their arrive)
    at once;
  - balance: every warpgroup takes the same number of turns, and at exit no turn barrier holds
    an arrival (the design consumes the last; "pp_no_final" shows it is exactly one, 128
    threads on warpgroup 1's barrier).
Work items: key ranges drawn three ways: independent random [t_lo, t_hi) (as ring_model), causal-
like (t_lo = 0, t_hi growing with the warpgroup, the last warpgroups' rows maybe past seq_q: no
keys) and all the block's tiles.

    python3 lab/candidates/fwd-pingpong/turn_model.py [SEEDS] [VARIANT,...]

Variants: "pp" (the candidate: a turn per key tile of the block for every warpgroup, empty
outside its range; skipped tiles passed over right before their turn; tail P V in no turn; the
last warpgroup's arrival on warpgroup 1's barrier at start; warpgroup 1's extra sync at exit),
"pp_no_final" (no sync at exit), "pp_s1" (the candidate at 1 stage: it deadlocks, as it must
where a skipped tile's pass-over waits for V(t) before tile t's turn while the loaders' V(t)
waits for P V(t - 1) of a warpgroup whose turn t comes later; the kernel static_asserts
STAGES >= 2 with PINGPONG: then the waits before turn t need only turns up to t - 1), and bugs the model must catch: "pp_skip_turns" (no turn on
tiles outside the warpgroup's range), "pp_pass_then_turn" (a warpgroup passes over all its
leading skipped tiles before taking their turns), "pp_no_prearrive" (no arrival at start),
"pp_two_tokens" (every warpgroup arrives on its successor's barrier at start), "pp_extra_turn"
(one turn too many past t_hi), "pp_tail_turn_some" (the tail P V in a turn, but only where
t_hi = n_tiles). Also ring_model's variants, unchanged ("old", "split", "vlag", bugs).

2026-12-07, 3000 seeds each (2-4 stages, 1-2 Q buffers, 2-3 warpgroups; in a sample of 600,
84% hold an item whose warpgroups' ranges differ, 81% a warpgroup with no key, 41% a t_lo past
the stage count): pp and pp_no_final 0 failures (pp_no_final: exactly 128 arrivals left on
warpgroup 1's barrier at exit, every time); pp_s1 deadlocks in 1713; the bugs are caught in
pp_skip_turns 2442, pp_pass_then_turn 496 (it needs t_lo > STAGES), pp_no_prearrive 3000,
pp_two_tokens 3000 (two warpgroups in a turn, or an agent arriving twice in one phase),
pp_extra_turn 2087, pp_tail_turn_some 2044; split (ring_model's) 0.
"""
import os, random, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "models"))
import ring_model  # noqa: E402

class NBar:  # a named barrier (bar.sync / bar.arrive with a thread count)
    def __init__(s, name, owner, pred, count=256):
        s.name, s.owner, s.pred, s.count = name, owner, pred, count
        s.arrived, s.phase, s.who = 0, 0, []
    def add(s, agent, kind, w, protocol=True):
        if protocol:
            wg = agent[0]
            assert (kind == "sync" and wg == s.owner) or (kind == "arrive" and wg == s.pred), \
                f"{s.name}: {kind} by warpgroup {wg} (owner {s.owner}, predecessor {s.pred})"
            assert agent not in s.who, f"{s.name}: {agent} {kind}s twice in phase {s.phase}"
        s.who.append(agent)
        joined = s.phase
        s.arrived += w
        if s.arrived == s.count: s.phase += 1; s.arrived = 0; s.who = []
        return joined

class Sim(ring_model.Sim):  # ring_model's, plus the turns' named barriers
    def __init__(s, seed, STAGES, QB, WGS, items, variant):
        super().__init__(seed, STAGES, QB, WGS, items, variant)
        s.nbar = [NBar(f"turn{g}", g, (g - 1) % WGS) for g in range(WGS)]
        s.in_turn = {g: set() for g in range(WGS)}  # halves between their sync and their arrive
        s.turns = {}  # agent -> turns taken
    def program(s, wg, half, w):
        return (s.consumer_pp if s.variant.startswith("pp") else super().program)(wg, half, w)
    # ---- ping-pong turns
    def nsync(s, bar, who, w):
        joined = bar.add(who, "sync", w)
        while bar.phase == joined: yield "blocked"
    def narrive(s, bar, who, w):
        bar.add(who, "arrive", w)
    def turn_begin(s, who, w):
        wg = who[0]
        yield from s.nsync(s.nbar[wg], who, w)
        others = [g for g in s.in_turn if g != wg and s.in_turn[g]]
        assert not others, f"ping-pong: warpgroups {wg} and {others} in a turn at once"
        s.in_turn[wg].add(who)
        s.turns[who] = s.turns.get(who, 0) + 1
    def turn_end(s, who, w):
        wg = who[0]
        s.in_turn[wg].discard(who)
        s.narrive(s.nbar[(wg + 1) % s.WGS], who, w)
    def consumer_pp(s, wg, half, w):
        who = (wg, half); ring, n = 0, 0; v = s.variant
        bufs = lambda kind, u: [(kind, u % s.S, l) for l in (0, 1)]
        qb = lambda n: [("Q", n % s.QB, l) for l in (0, 1)]
        def rd(kind, u, begin):
            for b in bufs(kind, u): (s.begin_read if begin else s.end_read)(who, b, u)
        def rq(n, begin):
            for b in qb(n): (s.begin_read if begin else s.end_read)(who, b, n)
        # the token starts with warpgroup 0: the last one's arrival stands for a turn before the first
        if wg == s.WGS - 1 and v != "pp_no_prearrive": s.narrive(s.nbar[0], who, w)
        if v == "pp_two_tokens" and wg != s.WGS - 1: s.narrive(s.nbar[wg + 1], who, w)
        while True:
            yield from s.wait(s.tile_ready[n % s.QB], (n // s.QB) & 1)
            x = s.slot[n % s.QB]
            if x >= len(s.items): break
            n_tiles, ranges = s.items[x]
            t_lo, t_hi = ranges[wg]
            def ring_pass(t):
                yield from s.ring_wait_full(s.full_k, ring + t); s.release(s.empty_k, ring + t, w)
                yield from s.ring_wait_full(s.full_v, ring + t); s.release(s.empty_v, ring + t, w)
            def empty_turn():
                yield from s.turn_begin(who, w); yield; s.turn_end(who, w)
            def pass_over(t):  # the kernel's pass_over: the rings, then the tile's (empty) turn
                yield from ring_pass(t)
                if v != "pp_skip_turns": yield from empty_turn()
            if v == "pp_pass_then_turn":
                for t in range(t_lo): yield from ring_pass(t)
                for t in range(t_lo): yield from empty_turn()
            else:
                for t in range(t_lo): yield from pass_over(t)
            yield from s.wait(s.q_full[n % s.QB], (n // s.QB) & 1)
            for t in range(t_lo, t_hi):
                u = ring + t
                yield from s.ring_wait_full(s.full_k, u)  # K(t), V(t - 1): before the turn
                if t > t_lo: yield from s.ring_wait_full(s.full_v, u - 1)
                yield from s.turn_begin(who, w)
                rq(n, True); rd("K", u, True)  # S(t) issued
                if t > t_lo: rd("V", u - 1, True)  # P V(t - 1) issued
                yield
                s.turn_end(who, w)
                yield
                rq(n, False); rd("K", u, False)  # wgmma_wait<1>
                s.release(s.empty_k, u, w)
                yield  # softmax
                if t > t_lo: rd("V", u - 1, False); s.release(s.empty_v, u - 1, w)  # wgmma_wait<0>
                yield
            if t_hi > t_lo:  # the tail, in no turn
                u = ring + t_hi - 1
                tail_turn = v == "pp_tail_turn_some" and t_hi == n_tiles
                yield from s.ring_wait_full(s.full_v, u)
                if tail_turn: yield from s.turn_begin(who, w)
                rd("V", u, True); yield
                if tail_turn: s.turn_end(who, w)
                rd("V", u, False)
                s.release(s.empty_v, u, w)
            s.qrelease(s.q_empty, n, w)
            for t in range(t_hi, n_tiles + (1 if v == "pp_extra_turn" and t_hi < n_tiles else 0)):
                if t < n_tiles: yield from pass_over(t)
                else: yield from empty_turn()
            yield  # epilogue
            ring += n_tiles; n += 1
        # the last turn's arrival (on warpgroup 0's barrier) is consumed before the block exits
        if wg == 0 and v != "pp_no_final": yield from s.nsync(s.nbar[0], who, w)
    def final_checks(s):
        if not s.variant.startswith("pp"): return
        t = set(s.turns.get((g, h), 0) for g in range(s.WGS) for h in (0, 1))
        assert len(t) == 1, f"balance: turns per agent {s.turns}"
        pending = [(b.name, b.arrived) for b in s.nbar if b.arrived]
        if s.variant == "pp_no_final":
            assert pending == [("turn0", 128)], f"at exit: pending {pending}"
        else:
            assert not pending, f"at exit: arrivals pending on {pending}"

def draw_items(r, WGS, mode):
    items = []
    for _ in range(r.randint(1, 6)):
        nt = r.randint(0, 7)
        ranges = []
        m = mode if mode != "mixed" else r.choice(["random", "causal", "full"])
        past = r.randint(0, WGS - 1) if r.random() < 0.3 else WGS  # warpgroups from `past` on: rows past seq_q
        for g in range(WGS):
            if m == "random":
                lo = r.randint(0, nt); hi = r.randint(lo, nt)
            elif m == "causal":  # keys 0 .. a diagonal that moves right with the rows
                lo, hi = 0, max(0, min(nt, nt - (WGS - 1 - g) * r.choice([0, 1, 1, 2])))
            else:
                lo, hi = 0, nt
            if m != "random" and g >= past: lo = hi = 0
            ranges.append((lo, hi))
        items.append((nt, ranges))
    return items

def check(variant, seeds, quiet=False, kinds=None):
    if not variant.startswith("pp"):  # ring_model's own variants, on its own draws
        return ring_model.check(variant, seeds, quiet)
    bad = 0
    for seed in range(seeds):
        r = random.Random(seed * 7919 + 1)
        # 2 or 3 computing warpgroups, 2-4 stages (the kernel: 2, 3)
        S, QB, WGS = r.choice([2, 3, 4]), r.choice([1, 2]), r.choice([2, 3])
        if variant == "pp_s1": S = 1  # the candidate at 1 stage (a static_assert forbids it)
        items = draw_items(r, WGS, "mixed")
        sim = Sim(seed, S, QB, WGS, items, variant)
        try:
            sim.run()
        except AssertionError as e:
            bad += 1
            k = str(e).split(":")[0]
            if kinds is not None: kinds[k] = kinds.get(k, 0) + 1
            if not quiet and bad <= 2: print(f"  {variant} seed {seed} S{S} QB{QB} WGS{WGS}: {str(e)[:160]}")
    return bad

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    for v in (sys.argv[2].split(",") if len(sys.argv) > 2 else ("pp", "pp_no_final", "pp_s1", "pp_skip_turns", "pp_pass_then_turn", "pp_no_prearrive", "pp_two_tokens", "pp_extra_turn", "pp_tail_turn_some", "split")):
        kinds = {}
        print(v, "failures:", check(v, n, kinds=kinds), "of", n, kinds if kinds else "")
