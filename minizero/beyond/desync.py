"""Ranks that fall out of step, named in seconds: collective fingerprints, a flight recorder and a
watchdog.

    minizero.launch(fn, 2)                       # on by default (stall_timeout, check_every below)
    minizero.launch(fn, 2, stall_timeout=None)   # no watchdog: a hang lasts the collective timeout
    python -m minizero.run --stall-timeout 10    # the CLI's switch, also under torchrun
    python -m pytest tests/test_desync.py        # the classic hangs, each named in one line

Why it is needed: a backend matches collectives by their order, not by what they are for. Rank r's
k-th collective meets every other rank's k-th, whatever each meant by it. When one rank's forward
takes another path (a block skipped, an MoE expert no token reached, one micro-batch more), the
sequences shift: collectives of the same size silently exchange the wrong tensors, and the first
pair that differs in size or kind hangs until the backend's timeout, with a message that names
nobody.

Every piece below watches comm's event stream ("collective" as one is issued, "collective done"
when it has completed: events.py), so comm itself knows nothing of it.

1. Fingerprints, checked before each collective runs. A collective's fingerprint is (kind,
   group size, element count, dtype, tag) at its sequence number `seq` (comm counts them; every
   rank issues the same sequence). The tag says which unit or bucket it is for, so two units of
   the same size exchanged in each other's place differ. The ranks agree on a hash of the
   fingerprints each issued since the last check (one all-reduce of two integers, [Note:
   agreement] below) at the points where they wait for each other anyway ([Note: where to
   agree]): before collective #1, before every blocking collective, and at the end of each
   backward (answered at the next check); with check_every=k instead, before every k-th
   collective. When they differ, every rank learns it at that same check: each puts its
   fingerprints on the process group's store, reads everyone's, and raises one line (DesyncError)
   naming the first collective they disagree on, the rank(s) out of step and what each issued.
   [Note: checking before, not on arrival] says why not in the collective's bytes.
2. The flight recorder: each rank's last RECORDED collectives, with when each was issued and
   finished. A watchdog thread puts them on the store every TICK_S, so that after any failure the
   launcher can print them (`report`), a killed rank's included.
3. The watchdog. Rank 0's thread also judges. When no rank has issued or finished a collective for
   SUSPECT_S while one waits, it compares the fingerprints not yet checked: a difference is named
   at once. When the stall lasts `stall_timeout` seconds, it names the rank that never issued the
   collective the others wait on. The verdict goes on the store, where minizero.launch looks for
   it (it then stops every rank and reports); elsewhere (torchrun) rank 0 prints it and exits, as
   NCCL's watchdog takes its process down, and torchrun stops the others.

Cost: a record and a hash per collective (microseconds) and, at each check, the agreement: a
two-integer all-reduce that waits for the slowest rank to reach the same point (measured on
training steps by python -m minizero.bench --desync; docs/performance.md). The store
is read only when the ranks disagree. Threads: the main thread records and checks, with a store
connection of its own; the watchdog has another (a TCPStore connection serves one request at a
time, and a check may wait on it for long).

[Note: checking before, not on arrival] The fingerprint could instead travel inside each
collective, a few bytes appended to the payload and compared on arrival. That needs every caller's
buffer to grow (or a copy of the payload per collective), cannot be exact in a bf16 sum or an int8
codec (beyond/quantize.py), and still lets the wrong data move: when the sizes differ it moves into
the wrong places, or hangs. A separate agreement of a 62-bit hash just before the collective is
exact, needs no change to any buffer or codec, and stops a mismatch before anything is exchanged.
Its price is one small round trip per check, and ranks meet there in step (an early rank waits
at the check instead of inside the collective).

[Note: where to agree] Agreeing before every collective meets the ranks in lockstep at each: at
stage 3 (27 collectives a step for the 8M GPT) that made whole steps about a quarter slower, most
of it waiting, because an asynchronous collective (a prefetched unit, a gradient bucket) lets a
rank run ahead while it is in flight, and a check before it takes that away. A blocking collective
waits for every rank anyway, and so does the end of backward: agreeing there costs a round trip,
not the overlap. Still, a round trip a step, with the ranks in lockstep after it, made stage 0 (one
all-reduce a step) 3-13 % slower at 2M parameters, N = 2, on a loaded machine (docs/performance.md):
so the end of a backward agrees without waiting, and reads the answer at the next check (the next
blocking collective, the next backward's end, or minizero.launch's end of the work). (Not the end
of the step: an fp16 step skipped on overflow emits no "step", so the ranks would not meet there
the same number of times if one skipped alone.) Before collective #1 it stops a model of another
size before anything moves; before a blocking one, a different size before gloo sees it. The
asynchronous collectives in between are in the next check's hash, so the first one that differs is
still the one named; what is given up is that their data may have moved (same-size units exchanged
in each other's place), until the next blocking collective or the end of the backward.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from minizero import comm, events

DEFAULT_STALL_TIMEOUT_S = float(os.environ.get("MINIZERO_STALL_TIMEOUT_S", "20"))
DEFAULT_CHECK_EVERY = 1       # agree where ranks wait anyway ([Note: where to agree]); k: k-th
RECORDED = 20       # collectives per rank in the flight recorder
UNCHECKED = 4096    # at most this many fingerprints wait for a check (one backward's, usually)
PUBLISHED = 256     # of them, the last this many are on the store for the watchdog
TICK_S = 0.25       # how often the watchdog publishes this rank's record (and rank 0 judges)
SUSPECT_S = 1.0     # nothing issued or finished anywhere for this long: compare what is unchecked
PREFIX = "minizero/desync/"
VERDICT = PREFIX + "verdict"

LIKELY_PATH = ("likely cause: a rank's forward or backward took another path; every rank must run "
               "every unit and the same number of micro-batches per step (engine.gathered() reads "
               "parameters outside forward)")
LIKELY_MODEL = "likely cause: the ranks built different models (every rank must build the same one)"


class DesyncError(RuntimeError):
    """The ranks issued different collectives at the same position: one line naming them."""


# ------------------------------------------------------------------------------------------------
# Fingerprints, and the verdicts in words
# ------------------------------------------------------------------------------------------------

def fingerprint(fields: dict) -> dict:
    """What a "collective" event says about the collective, as plain data for the store."""
    group = fields["group"]
    return {"seq": fields["seq"], "kind": fields["kind"], "tag": fields["tag"],
            "ranks": None if group is None else list(group.ranks), "numel": fields["numel"],
            "dtype": str(fields["dtype"]).removeprefix("torch.")}


def _key(fp: dict) -> tuple:
    """What must be equal on every rank. A group by its size only: with HSDP, rank 0's shard group
    is ranks 0-1 while rank 2's is ranks 2-3, and that is the same collective."""
    return fp["kind"], fp["ranks"] and len(fp["ranks"]), fp["numel"], fp["dtype"], fp["tag"]


def _digest() -> "hashlib.blake2b":
    return hashlib.blake2b(digest_size=8)


def describe(fp: dict) -> str:
    """'all_gather of 8,256 float32 elements for unit 4 (blocks.3)'."""
    text = f"{fp['kind']} of {fp['numel']:,} {fp['dtype']} elements"
    if fp["tag"]:
        text += f" for {fp['tag']}"
    if fp["ranks"] is not None:
        text += f" over ranks {', '.join(map(str, fp['ranks']))}"
    return text


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def mismatch(windows: list[list[dict]]) -> str | None:
    """The first collective the ranks disagree on, in one line, or None. windows[r]: rank r's
    fingerprints (any stretch of its sequence); only positions every rank has are compared. The rank
    named is the odd one out: against the majority, ties going to rank 0's side."""
    by_seq = [{fp["seq"]: fp for fp in window} for window in windows]
    for seq in sorted(set.intersection(*(set(s) for s in by_seq))):
        keys = [_key(s[seq]) for s in by_seq]
        if len(set(keys)) == 1:
            continue
        common = max(set(keys), key=lambda k: (keys.count(k), k == keys[0]))
        odd = [r for r, k in enumerate(keys) if k != common]
        ref = keys.index(common)
        theirs, ours = by_seq[odd[0]][seq], by_seq[ref][seq]
        also = f" ({_ranks(odd[1:])} too)" if len(odd) > 1 else ""
        same_role = (theirs["kind"], theirs["tag"]) == (ours["kind"], ours["tag"])
        cause = LIKELY_MODEL if same_role and theirs["numel"] != ours["numel"] else LIKELY_PATH
        return (f"rank {odd[0]} issued {describe(theirs)} as collective #{seq}{also}, where rank "
                f"{ref} issued {describe(ours)}; {cause}")
    return None


def blocked_on(state: dict) -> int | None:
    """The collective a rank waits on: its first unfinished one after the last it completed (one
    group completes in order). One still pending below that was never waited for (an unused
    prefetch), so it blocks nobody."""
    after = [seq for seq in state["pending"] if seq > state["finished"]]
    return min(after) if after else None


def stall(states: list[dict], waited_s: float) -> str:
    """One line for a run in which nothing has moved for `waited_s` seconds: who waits on which
    collective, and who never issued it."""
    waiting_on = {r: blocked_on(st) for r, st in enumerate(states) if blocked_on(st) is not None}
    seq = min(waiting_on.values())
    waiting = [r for r, s in waiting_on.items() if s == seq]
    fp = next((f for f in states[waiting[0]]["recent"] if f["seq"] == seq), None)
    what = f" ({describe(fp)})" if fp else ""               # None: older than the flight recorder
    head = f"{_ranks(waiting)} waited {waited_s:.0f} s on collective #{seq}{what}"
    missing = [r for r, st in enumerate(states) if st["issued"] < seq]
    if not missing:
        return f"{head}, which every rank issued: the backend or the network is stuck"
    last = states[missing[0]]["recent"]
    before = f"its last was #{last[-1]['seq']} ({describe(last[-1])})" if last else "it issued none"
    if len(waiting) < len(missing):
        cause = (f"{_ranks(waiting)} issued more collectives than the others (an extra "
                 "micro-batch, or a collective only some ranks run?)")
    else:
        cause = (f"{_ranks(missing)} issued fewer (a skipped unit, a collective behind an "
                 "`if rank`?) or are busy outside minizero.comm")
    return f"{head}, which {_ranks(missing)} never issued ({before}); {cause}"


# ------------------------------------------------------------------------------------------------
# One rank's watch
# ------------------------------------------------------------------------------------------------

def _state_key(rank: int) -> str:
    return f"{PREFIX}state/{rank}"


def _check_key(check: int, rank: int) -> str:
    return f"{PREFIX}check/{check}/{rank}"


# --- agreement: do all ranks hold the same number? ------------------------------------------------
_agreement: tuple | None = None   # (the default process group it was made in, its own group)


def open_agreement() -> None:
    """Make the process group that `agree` runs on. Collective (dist.new_group): every rank calls it
    at the same point; once per process group (later calls do nothing)."""
    global _agreement
    world = dist.distributed_c10d._get_default_group()
    if comm.world_size() > 1 and (_agreement is None or _agreement[0] is not world):
        _agreement = (world, dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=comm.DEFAULT_TIMEOUT_S)))


def agree(value: int) -> bool:
    """Whether every rank called agree() with the same `value` (an integer, |value| < 2**62).

    [Note: agreement] One all-reduce with MAX over [value, -value] (int64): every rank gets the
    largest value and minus the smallest, and all are equal exactly when largest == smallest.
    Integers, so nothing rounds; MAX, so every rank gets the same answer at the same call. It runs
    on a group of its own, on the CPU with gloo whatever the backend: on the training group it
    would queue behind every collective still in flight (and wait for them), and on NCCL reading
    its answer would wait for the GPU. Not tallied, not an event: it is not part of ZeRO's
    algorithm, and it is not a collective of the stream it checks. Blocks until every rank calls
    it (open_agreement first)."""
    if comm.world_size() == 1:
        return True
    pair = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=_agreement[1])
    return int(pair[0]) == value == -int(pair[1])


class Agreement:
    """agree_later's answer, once every rank has given its value: wait() -> whether all agree."""

    def __init__(self, value: int, pair: torch.Tensor | None = None, work=None):
        self.value, self.pair, self.work = value, pair, work

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        return self.pair is None or int(self.pair[0]) == self.value == -int(self.pair[1])


def agree_later(value: int) -> Agreement:
    """agree() without waiting: the answer is read later, when every rank has long given its
    value (the end of a backward, where waiting costs a round trip a step: [Note: where to
    agree])."""
    if comm.world_size() == 1:
        return Agreement(value)
    pair = torch.tensor([value, -value], dtype=torch.int64)
    return Agreement(value, pair, dist.all_reduce(pair, op=dist.ReduceOp.MAX, async_op=True,
                                                  group=_agreement[1]))


class Watch:
    """This rank's recorder, fingerprint checks and watchdog thread. Made by `watch`; stop() ends
    it."""

    def __init__(self, store: dist.Store, stall_timeout: float | None, check_every: int,
                 on_verdict):
        self.rank, self.n = comm.rank(), comm.world_size()
        self.stall_timeout, self.check_every = stall_timeout, check_every
        self.on_verdict = on_verdict
        self.store, self.thread_store = store.clone(), store.clone()     # see "Threads" above
        self.recent: collections.deque = collections.deque(maxlen=RECORDED)
        # since the last check: a backward's collectives, with checks where ranks wait anyway
        self.unchecked: collections.deque = collections.deque(maxlen=max(check_every, UNCHECKED))
        self.pending: dict[int, dict] = {}              # seq -> its record: issued, not finished
        self.issued, self.finished, self.moved_at = 0, 0, time.time()
        self.digest = _digest()                         # of the keys issued since the last check
        self.checks = 0                                 # agreements so far: the same on every rank
        self.unanswered = None      # the end of the last backward's agreement: answered at the next
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        open_agreement()
        self.unsubscribe = events.subscribe(self.on_event)
        self.thread = threading.Thread(target=self.run, name="minizero-desync", daemon=True)
        self.thread.start()

    # --- the main thread: record, and check every check_every collectives --------------------
    def on_event(self, name: str, fields: dict) -> None:
        if name == "collective":
            fp = fingerprint(fields)
            record = dict(fp, issued=time.time(), finished=None)
            with self.lock:
                self.recent.append(record)
                self.unchecked.append(fp)
                self.pending[fp["seq"]] = record
                self.issued, self.moved_at = fp["seq"], record["issued"]
            self.digest.update(repr(_key(fp)).encode())
            if self.check_every == 1:                          # [Note: where to agree]
                due = fp["seq"] == 1 or fields["blocking"]
            else:
                due = self.check_every and (fp["seq"] == 1 or fp["seq"] % self.check_every == 0)
            if due:
                self.check(fp["seq"])
        elif name == "backward done" and self.check_every == 1:
            self.check(self.issued, wait=False)                # [Note: where to agree]
        elif name == "collective done":
            with self.lock:
                record = self.pending.pop(fields["seq"], None)
                if record is not None:
                    record["finished"] = self.moved_at = time.time()
                    self.finished = max(self.finished, fields["seq"])

    def check(self, seq: int, wait: bool = True) -> None:
        """Agree with every rank on the fingerprints since the last check, before collective #seq
        runs; when they differ, name the first difference (on every rank) and raise. Waits for
        every rank to reach #seq: one that never does is the watchdog's to name. wait=False (the
        end of a backward): the answer is read at the next check (settle), not waited for here."""
        self.settle()
        value = int.from_bytes(self.digest.digest(), "big") >> 2        # 62 bits: see agree()
        self.digest = _digest()
        self.checks += 1
        with self.lock:
            window = list(self.unchecked)
        if not wait:
            self.unanswered = (agree_later(value), seq, self.checks, window)
            return
        self._answer(agree(value), seq, self.checks, window)

    def settle(self) -> None:
        """Read the answer of the last agreement not waited for (and raise if the ranks differ
        there). Every check does first; minizero.launch once the work is done."""
        if self.unanswered is not None:
            agreement, seq, check, window = self.unanswered
            self.unanswered = None
            self._answer(agreement.wait(), seq, check, window)

    def _answer(self, agreed: bool, seq: int, check: int, window: list[dict]) -> None:
        with self.lock:                                  # checked now: up to #seq
            while self.unchecked and self.unchecked[0]["seq"] <= seq:
                self.unchecked.popleft()
        if agreed:
            return
        # Every rank is here, at the same collective (the agreement's answer is the same on all):
        # the store says what each issued, for one line that names them
        self.store.set(_state_key(self.rank), json.dumps(self.state()))   # for the report, now
        self.store.set(_check_key(check, self.rank), json.dumps(window))
        keys = [_check_key(check, r) for r in range(self.n)]
        self.store.wait(keys, datetime.timedelta(seconds=comm.DEFAULT_TIMEOUT_S))
        verdict = mismatch([json.loads(v) for v in self.store.multi_get(keys)])
        if verdict is None:                      # a hash collision, the other way: cannot happen
            verdict = (f"the ranks disagree on the collectives since their last check (rank "
                       f"{self.rank}: up to #{seq})")
        self.store.compare_set(VERDICT, "", verdict)              # the first verdict stands
        self.on_verdict(verdict)
        raise DesyncError(f"ranks out of step: {verdict}")

    # --- the watchdog thread -----------------------------------------------------------------
    def state(self) -> dict:
        with self.lock:
            return {"issued": self.issued, "finished": self.finished,
                    "pending": sorted(self.pending), "moved_at": self.moved_at,
                    "recent": [dict(r) for r in self.recent],
                    "unchecked": list(self.unchecked)[-PUBLISHED:]}   # the watchdog compares these

    def run(self) -> None:
        while True:           # publish at once, then every TICK_S: a rank killed early is on record
            self.thread_store.set(_state_key(self.rank), json.dumps(self.state()))
            verdict = self.judge() if self.rank == 0 else None
            if verdict is not None:
                self.thread_store.compare_set(VERDICT, "", verdict)
                self.on_verdict(verdict)
                return
            if self.stopped.wait(TICK_S):
                return

    def judge(self) -> str | None:
        keys = [_state_key(r) for r in range(self.n)]
        if not self.thread_store.check(keys):
            return None                                 # a rank has not published yet
        states = [json.loads(v) for v in self.thread_store.multi_get(keys)]
        still_s = time.time() - max(st["moved_at"] for st in states)
        if still_s < SUSPECT_S or all(blocked_on(st) is None for st in states):
            return None
        found = mismatch([st["unchecked"] for st in states])
        if found is None and self.stall_timeout is not None and still_s >= self.stall_timeout:
            found = stall(states, still_s)
        return found

    def stop(self) -> None:
        self.unsubscribe()
        self.stopped.set()
        self.thread.join()


def watch(store: dist.Store | None = None,
          stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
          check_every: int = DEFAULT_CHECK_EVERY, on_verdict=None) -> Watch | None:
    """Watch this rank's collectives (after comm.init; None with one rank).
    store: the process group's (default: the default group's, as under torchrun).
    stall_timeout: seconds without progress before the watchdog stops the run (None: never; a
      mismatch is still named). check_every: agree on the fingerprints on every rank before #1 and
      every k-th collective (default 1: every one; 0: only when the run stalls).
    on_verdict(line): what rank 0's watchdog, and every rank's check, does with a verdict before
      the check raises DesyncError; default: print it (rank 0 with the flight recorder) and exit,
      for torchrun to stop the others (minizero.launch's parent reports them, from the store)."""
    if comm.world_size() == 1:
        return None
    store = store or dist.distributed_c10d._get_default_store()
    return Watch(store, stall_timeout, check_every, on_verdict or _exit_with(store))


def _exit_with(store: dist.Store):
    def leave(verdict: str) -> None:
        # every rank that finds the mismatch leaves; rank 0 also prints the flight recorder
        recorder = report(store, comm.world_size()) if comm.rank() == 0 else ""
        print(f"minizero: ranks out of step: {verdict}{recorder}", file=sys.stderr, flush=True)
        os._exit(1)
    return leave


# ------------------------------------------------------------------------------------------------
# Reading it back (minizero.launch's parent, which hosts the store)
# ------------------------------------------------------------------------------------------------

def verdict(store: dist.Store) -> str | None:
    """The verdict of a run, if one was reached."""
    return store.get(VERDICT).decode() if store.check([VERDICT]) else None


def report(store: dist.Store, world_size: int) -> str:
    """Every rank's flight recorder as its watchdog last published it, on lines of their own after a
    newline: the last collectives, each with how long ago it was issued and finished ('waiting' when
    it never was). Empty when no rank recorded anything (the watch was off)."""
    now = time.time()
    recorded = [r for r in range(world_size) if store.check([_state_key(r)])]
    if not recorded:
        return ""
    lines = ["", f"--- the last {RECORDED} collectives of each rank (minizero.beyond.desync) ---"]
    for r in range(world_size):
        if r not in recorded:
            lines.append(f"rank {r}: nothing recorded")
            continue
        st = json.loads(store.get(_state_key(r)))
        lines.append(f"rank {r}: issued {st['issued']} collectives, waiting on "
                     f"{blocked_on(st) or 'none'}")
        for rec in st["recent"]:
            done = ("waiting" if rec["finished"] is None else
                    f"finished {now - rec['finished']:.1f} s ago")
            lines.append(f"  #{rec['seq']:<5} {describe(rec)}: issued {now - rec['issued']:.1f} s "
                         f"ago, {done}")
    return "\n".join(lines)
