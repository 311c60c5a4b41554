"""One step of dynamic mode: every forward op captured as a recipe, packs held or dropped under the cap.

A step begins at a training forward (the handle's root pre-hook) and stays in forward, the loss
included, until backward begins. Its dispatch mode (handle.py) hands it every counted op:

* forward: the op is captured (`recompute.capture_op`: arguments the step produced become `Ref`s, written
  buffers `Scratch` copies, random ops keep their RNG state), timed with `op_clock` (time.perf_counter), and each
  storage it wrote gets a node (nodes.py) in the step's writer map;
* backward: the op's outputs are counted as memory in use on CPU (cap_memory.py), and each op gets room for
  what it made in the step before (Note [ Room for the next op ]); a forward op too.

Pack: a tensor whose storage an op of the step wrote is held by its node and autograd gets a `Held`
handle; then the step makes room under the cap (eviction.py), which may drop held nodes. Anything else
(parameters, the batch, tensors packed in backward) is kept as is. Unpack: the node is materialized
(rebuilt if dropped, recursively; copied back if swapped out: swaps.py) and the entry viewed over it. A
node is let go when autograd frees its last handle; the step is released (nodes, captures) once backward
began and no handle is left, once a later step started and no handle is left, or at once when aborted.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from regen.errors import RegenError
from regen.opinfo import is_inplace, is_random, op_outputs, storage_key, tensor_outputs, written_outputs
from regen.runtime import stacks
from regen.runtime.dynamic.backward_figures import BackwardFigures, BackwardGate, BackwardRecord
from regen.runtime.dynamic.cap_memory import new_storage_bytes
from regen.runtime.dynamic.nodes import TensorNode, new_node
from regen.runtime.dynamic.eviction import Residency
from regen.runtime.dynamic.eviction import HEADROOM_PER_OUTPUT, REPLAYS_PER_FORWARD_OP
from regen.runtime.writers import Writer, live_writer
from regen.runtime.recompute import capture_op
from regen.runtime.saved_entries import Untracked
from regen.runtime.storage_views import Geometry, view_of
from regen.runtime.tracker import regen_ops
from regen.runtime.peak_check import PEAK_TOLERANCE
from regen.units import format_bytes

# what a forward op's rebuild cost is timed with: wall time (on CUDA, the launch's), the policy's costs (policy.py)
op_clock = time.perf_counter


# NOTE [ Headroom in backward ]
# Each check keeps a headroom free for what the runtime does not see coming (eviction.py): a temporary as large
# as the largest storage an op made so far (Note [ Room for the next op ]). Backward runs the forward ops'
# gradients in reverse, so at the unpack of op i's output the ops still to come are those of ops up to about
# i, and "the largest so far" goes back to what it was after op i in forward. Kept at its largest all through
# backward, a language model's logits (by far its largest storage, made last) would hold their size free in
# every layer's backward: every check then evicts all it can and the next unpack rebuilds it again (GPT-2's
# vocabulary of 50,257: thousands of rebuilds a step at any cap).


# NOTE [ Room for the next op ]
# A forward op's check runs before the op allocates its outputs and keeps room for them and for a temporary
# (the headroom: as large as the largest storage made so far; a CPU convolution's buffers, which the runtime
# does not track). Its outputs: training repeats its forward, so each step records, per forward op, the op and
# the bytes of the storages it made, and the next step's check before op i keeps room for what op i made last
# time, when op i is the same op (the last step of the same call: call_signature.signature_key; a step of a
# call not seen before gets the step before's figure, a fair guess: it only sets how much is dropped ahead);
# otherwise for a storage as large as the largest so far, which cannot see a storage larger than any before it.
# A matrix product's output is known from its operands, so its check keeps room for exactly that in every
# step (`matrix_product_bytes`): a language model's logits, made by one product after the last block, several
# times any block's tensor, took the zoo Llama's first step 8% over its cap before. Backward alike, op by op: a
# gradient as large as the logits comes right at its start; on CPU a backward op's check also keeps room for
# the temporaries the op allocated and freed inside itself in the recorded step (transients.py), which no check
# sees otherwise. Where a reading of the memory costs (CUDA: the allocator's statistics), a backward op gets a
# check only when it made more the step before than the largest so far, and the checks at unpacks keep the room for
# the op's outputs too (a headroom of HEADROOM_PER_OUTPUT x the largest). The checks at packs, and at unpacks
# and rebuilds of a step whose ops have not all made what the step before's made, keep HEADROOM_PER_OUTPUT x
# the largest as well, and so do all of them where a host link holds memory no check can drop
# (_backward_headroom_per_output). Where both are known in backward (every op so far made what it made the
# step before, and the recorded step's temporaries are learned), a backward op's check keeps room for exactly
# them and the unpacks keep no headroom: a temporary as large as the largest storage on top of them kept
# 15% of the built-in GPT's cap unused at half its increase, and rebuilt 59 tensors a step where 36 do.


_MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
_BMM = (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)


def matrix_product_bytes(func, args) -> int | None:
    """The bytes of a matrix product's output, from its operands' shapes (None for any other op): its check keeps
    room for exactly that, in a step of a new shape too. A language model's logits, one product after its last
    block, are several times any tensor before them, so a guess from the largest so far misses them (the zoo's
    Llama at bench size: its first step 8% over its cap), and the step before's figure misses a longer batch's."""
    if func in _MM:
        a, b = args[-2], args[-1]
        return a.shape[0] * b.shape[1] * a.element_size()
    if func in _BMM:
        a, b = args[-2], args[-1]
        return a.shape[0] * a.shape[1] * b.shape[2] * a.element_size()
    return None


class OverCapWarning(UserWarning):
    """A dynamic step's memory passed its cap with nothing left to evict (the result stays exact)."""



# NOTE [ Counted to the backward's end ]
# A step is let go (its nodes and captures dropped, the dispatch mode passing its ops by) once autograd holds
# none of its handles. Backward's last nodes often hold none: a patch embedding's convolution saved the batch and
# its weight, an embedding its token ids. Let go at its last unpack, the step's ops after it went uncounted: the
# held-out VideoMAE's convolution backward, its weight's gradient and 0.3 MiB of temporaries, took every step to
# 1.19x a cap the count read 1.03x of, with no warning. So the first backward op or unpack, inside autograd's
# backward, queues a callback for that backward's end (`queue_callback`), and the step is let go only after it:
# every backward op is checked and counted (and recorded: transients.py, backward_figures.py) to the end.


class Held:
    """What autograd stores for a saved entry of a node: the node and the entry's view geometry."""

    __slots__ = ("step", "node", "geometry")

    def __init__(self, step: "DynamicStep", node: TensorNode, geometry: Geometry):
        self.step = step
        self.node = node
        self.geometry = geometry

    def __del__(self):
        try:
            self.step.handle_died(self.node)
        except Exception:  # interpreter shutdown; never raise from a finaliser
            pass


class DynamicStep:
    """One training step in dynamic mode; `pack` and `unpack` are its saved-tensor hooks."""

    def __init__(self, memory, cap_bytes: int, policy: str, stats, pause: Callable, released: Callable,
                 swaps, device_type: str, peak_at_start_bytes: int | None):
        self.memory = memory
        self.device_type = device_type  # a tensor saved on another device (a host random seed) is only held
        self.peak_at_start_bytes = peak_at_start_bytes  # the allocator's peak so far when it began (CUDA), or None
        self.cap_bytes = cap_bytes
        self.stats = stats
        self.pause = pause  # () -> a context manager during which the dispatch mode passes ops through
        self._released_cb = released
        self.nodes: dict[tuple[int, int], TensorNode] = {}
        self.captures: dict = {}
        self.writer: dict[int, Writer] = {}
        self.count = 0  # forward ops
        self.largest_bytes = 0  # the largest storage an op made so far (in backward: after its op in forward)
        self.largest_upto: list[int] = []  # forward op -> the largest storage made up to it
        # forward op, backward op -> (op, bytes of the storages it made) (Note [ Room for the next op ])
        self.made_forward: list[tuple] = []
        self.made_backward: list[tuple] = []
        self.foreseen: tuple[list, list] | None = None  # the step before's (made_forward, made_backward): foresee()
        # CPU: backward op -> its temporaries, learned by an earlier step (transients.py), or None; whether a step
        # of this step's call learned them (else another call's: a guess); and the recorder learning them in this
        # step's backward, or None
        self.temporaries: dict[int, int] | None = None
        self.temporaries_exact = False
        self.recorder = None
        self.foresight_exact = False  # every op so far made what it made in the step before
        self.in_backward = False
        self.closed = False  # a later step started
        self.aborted = False
        self.released = False
        self.live = 0  # handles autograd holds
        self.warned = False  # its memory passed the cap + PEAK_TOLERANCE (count, learned temporaries or allocator)
        # Note [ Counted to the backward's end ]: its backward asked to be told its end, and has ended
        self.end_awaited = False
        self.backward_ended = False
        self._tail_from: int | None = None  # learning: the first op after the model returned (learned.py)
        self._tail_ops: list | None = None
        self.start_bytes = memory.start_bytes  # the model's memory at its start (begin_step ran)
        # Note [ A backward without the dispatch mode ]: this backward's record (under the mode, CPU without a host
        # link), or the figures it runs on without the mode, the gate that lets it, and the count of its unpacks
        self.record: BackwardRecord | None = BackwardRecord() if memory.cheap_reads and swaps is None else None
        self.figures: BackwardFigures | None = None
        self.gate: BackwardGate | None = None
        self.gate_up = False  # pushed (popped once the step closed and it is on top: drop_gate)
        self.ops_at_backward: int | None = None  # forward ops counted when the program's backward call began
        self.mode_free = False
        self.unpacks = 0
        self._leave_mode: Callable[[], bool] = lambda: False
        self.call_key = None  # its call (call_signature.signature_key), or None
        self.midway = False  # it took over a planned step's forward midway (regen.runtime.apply)
        self.residency = Residency(self.nodes, self.captures, memory, cap_bytes, policy, stats, self._over_cap,
                                   lambda: self.largest_bytes, lambda: self.count, self._thrashing, swaps)

    # ---- ops (the handle's dispatch mode) ---------------------------------------------------------
    def forward_op(self, func, args, kwargs):
        i = self.count
        self.count = i + 1
        if self.midway:  # the storages its ops read that the planned part made (CPU)
            self.memory.track_tensors((*args, *kwargs.values()))
        cap = capture_op(i, func, args, kwargs, self.writer, is_random(func))
        self.captures[i] = cap
        clock = self.residency.clock = self.residency.clock + 1
        self.residency.make_room(*self._room_for(0, i, func, args), copy_out_ahead=True)  # before it allocates
        nodes = self.nodes
        for key in cap.refs:
            node = nodes.get(key)
            if node is not None:
                node.last_access = clock
        start = op_clock()
        out = func(*args, **kwargs)
        op_time_s = op_clock() - start
        outs = op_outputs(func, args, kwargs, out)
        written = written_outputs(func, args, kwargs, outs)
        made_bytes = 0
        if written:
            inplace = is_inplace(func)
            returned = len(tensor_outputs(out))
            for slot, key in written:
                t = outs[slot]
                w = live_writer(self.writer, key)
                if slot >= returned and w is None:  # an argument it writes that the step did not make (a buffer)
                    continue
                previous = nodes.get((w.op, w.slot)) if w is not None else None
                node = nodes[(i, slot)] = new_node((i, slot), t, cap.refs, previous, inplace, op_time_s, clock)
                for k in node.inputs:
                    m = nodes[k]
                    m.dependents.append(node.key)
                    node.evictable = node.evictable and m.evictable  # its rebuild may need m rebuilt
                self.writer[key] = Writer.of(i, slot, t)
                self.memory.track(t)
                if node.nbytes > self.largest_bytes:
                    self.largest_bytes = node.nbytes
                    self.residency.headroom_bytes = HEADROOM_PER_OUTPUT * node.nbytes
                if not inplace:
                    made_bytes += node.nbytes
        self.largest_upto.append(self.largest_bytes)
        self.made_forward.append((func, made_bytes))
        if self.foresight_exact:
            self._compare_foresight(0, i, (func, made_bytes))
        self._read_after_op(func)
        return out

    # ---- a backward without the dispatch mode (backward_figures.py) --------------------------------
    def gate_backward(self, figures: BackwardFigures | None, leave_mode: Callable[[], bool]) -> None:
        """Raise a gate at the backward call once the model returned: it notes the forward ops counted then,
        and with `figures`, runs the backward on them without the dispatch mode when the forward made what the
        step before's made (`leave_mode()` pops the mode; False: it could not)."""
        self.figures = figures
        self._leave_mode = leave_mode
        self.gate = BackwardGate(self._open_backward)

    def model_returned(self) -> None:
        """The model's root call returned: the gate goes up (the loss and the backward call come next)."""
        gate = self.gate
        if gate is not None and not self.gate_up and not self.in_backward and not self.closed:
            gate.__enter__()
            self.gate_up = True

    def _open_backward(self) -> None:
        """The gate fired: the program's backward call, before it starts."""
        self.ops_at_backward = self.count
        figures = self.figures
        if (figures is None or self.closed or self.released or self.in_backward or not self.foresight_exact
                or self.count != figures.ops_at_backward or not self._leave_mode()):
            return
        self.mode_free = True
        self.record = None
        self.stats.backwards_without_mode += 1
        self.residency.make_room(0, headroom_bytes=figures.rise_bytes[0])

    def drop_gate(self) -> None:
        """The step closed: its gate, if one went up, fires no more and is popped once on top."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.disarm()
            stacks.take_out(gate)  # nothing when it never went up

    def _figures_at_unpack(self) -> None:
        """Unpack k of a backward without the mode: the recorded live bytes counted, the recorded rise kept free."""
        k, figures = self.unpacks, self.figures
        if k < len(figures.live_bytes):
            self.memory.untracked_bytes = figures.live_bytes[k]
            self.residency.headroom_bytes = figures.rise_bytes[k + 1]
        else:  # past the recorded backward
            self.memory.untracked_bytes = max(figures.live_bytes)
            self.residency.headroom_bytes = HEADROOM_PER_OUTPUT * self.largest_bytes

    def foresee(self, foreseen: tuple[list, list] | None) -> None:
        """What the step before made, op by op (Note [ Room for the next op ]); exact until an op differs."""
        self.foreseen = foreseen
        self.foresight_exact = foreseen is not None

    def _backward_headroom_per_output(self) -> int:
        """The headroom at backward's unpacks and rebuilds, in multiples of the largest storage so far (Note
        [ Room for the next op ]): none where every backward op's own check keeps room for exactly what it made
        the step before and its learned temporaries; one (a temporary) where it keeps room for exactly
        what it made the step before (foresight exact, cheap reads) and every byte in use is one a check can
        drop (no host link: a copy-in in flight or a copy-out not yet landed holds memory no check frees; with
        one headroom the step passed its cap by 5.5% under load); else HEADROOM_PER_OUTPUT (an output and a
        temporary). Forward keeps HEADROOM_PER_OUTPUT: one there as well took a CNN's convolution temporaries
        past its cap."""
        exact = self.foresight_exact and self.memory.cheap_reads and self.residency.swaps is None
        if exact and self.temporaries_exact:  # every backward op's check keeps room for all it needs
            return 0
        return 1 if exact else HEADROOM_PER_OUTPUT

    def _foreseen_bytes(self, phase: int, i: int, func) -> int | None:
        """What op `i` of forward (`phase` 0) or backward (1) made in the step before, when it was the same op
        (Note [ Room for the next op ]); None otherwise."""
        seen = None if self.foreseen is None else self.foreseen[phase]
        if seen is None or i >= len(seen) or seen[i][0] is not func:
            return None
        return seen[i][1]

    def _room_for(self, phase: int, i: int, func, args=()) -> tuple[int, int]:
        """(need, headroom) of the check before op `i` of forward (`phase` 0) or backward (1) (Note [ Room for
        the next op ]): when it is the op of the step before, what it made then and one temporary as large as
        the largest storage so far (a backward op whose temporaries were learned: them, and no headroom, while
        every op so far made what it made the step before and no host link holds memory); else no figure and a
        headroom of HEADROOM_PER_OUTPUT x the largest (the output guessed: a check that cannot keep a guess free
        is not over its cap); a forward matrix product keeps room for its output's bytes, known from its operands,
        and one temporary."""
        product_bytes = matrix_product_bytes(func, args) if phase == 0 else None
        if product_bytes is not None:  # known whatever the step before made
            return product_bytes, self.largest_bytes
        foreseen = self._foreseen_bytes(phase, i, func)
        if foreseen is None:
            return 0, HEADROOM_PER_OUTPUT * self.largest_bytes
        if phase == 1 and self.temporaries is not None:  # what the op allocates and frees inside itself
            foreseen += self.temporaries.get(i, 0)
            if self.foresight_exact and self.temporaries_exact and self.residency.swaps is None:  # all it needs
                return foreseen, 0
        if self.foresight_exact:
            return foreseen, self.largest_bytes
        return max(0, foreseen - self.largest_bytes), HEADROOM_PER_OUTPUT * self.largest_bytes

    def _compare_foresight(self, phase: int, i: int, made: tuple) -> None:
        """Op `i` of `phase` made `made` (op, bytes): foresight stays exact while every op makes what it made in
        the step before (a step of the same shape)."""
        seen = self.foreseen[phase]  # exact foresight has a step before
        if i >= len(seen) or seen[i][0] is not made[0] or seen[i][1] != made[1]:
            self.foresight_exact = False

    def backward_op(self, func, args, kwargs):
        self._in_backward()
        i = len(self.made_backward)
        if not self.released:  # before the op allocates its outputs
            if self.memory.cheap_reads:
                need, headroom = self._room_for(1, i, func)
                self.residency.make_room(need, headroom_bytes=headroom)
            else:
                foreseen = self._foreseen_bytes(1, i, func) or 0
                if foreseen > self.largest_bytes:
                    # only past the largest: the unpacks' headroom keeps room for that much (Note [ Room ... ])
                    self.residency.make_room(foreseen - self.largest_bytes)
        record = self.record
        live = self.memory.backward_bytes if record is not None else 0
        if self.recorder is None or not self.recorder.recording:
            out = func(*args, **kwargs)
        else:  # learning the ops' temporaries (transients.py)
            with self.recorder.around(i):
                out = func(*args, **kwargs)
        made_bytes = 0
        for t in tensor_outputs(out):
            nbytes = new_storage_bytes(t, args) if t is not None else 0
            if nbytes:  # not a view of an argument: the batch's storage, which a backward op may view, is not counted
                self.memory.track(t, made_in_backward=True)
                made_bytes += nbytes
        if record is not None:
            record.op(live, made_bytes, i)
        if self.foresight_exact:
            self._compare_foresight(1, i, (func, made_bytes))
        self.made_backward.append((func, made_bytes))
        self._read_after_op(func, self.temporaries.get(i, 0) if self.temporaries_exact else 0)
        return out

    def _read_after_op(self, func, temporary_bytes: int = 0) -> None:
        """Where a reading is cheap (CPU), the count right after an op is what the allocator holds then (the op's
        own temporaries are freed; cap_memory.py), and with the op's learned `temporary_bytes` (transients.py:
        the most it held inside over what it holds at its end) what it held at its peak inside: the step's peak,
        and past the cap + PEAK_TOLERANCE one OverCapWarning with it (the check before the op foresaw less than
        the op made, or could drop nothing)."""
        if not self.memory.cheap_reads:
            return
        peak_bytes = self.memory.in_use_bytes() + temporary_bytes
        if peak_bytes > self.stats.peak_in_use_bytes:
            self.stats.peak_in_use_bytes = peak_bytes
        if peak_bytes > self.cap_bytes * (1 + PEAK_TOLERANCE) and not self.warned:
            self._warn_over_cap(f"{format_bytes(peak_bytes)} in use at {func} passes the cap "
                                f"{format_bytes(self.cap_bytes)}: the op made more than its check kept room for (its "
                                f"outputs, its own temporaries), or nothing more could be dropped; this step runs over "
                                f"the cap, its results exact. Raise the cap or lower the batch size")

    # ---- saved-tensor hooks -----------------------------------------------------------------------
    def packs_no_more(self) -> bool:
        """Its saved set is final (backward began, the model's next call began, or it was released)."""
        return self.in_backward or self.closed or self.released

    def pack(self, x: torch.Tensor):
        with regen_ops():  # regen's own ops (detach) are never captured
            return self._pack(x)

    def _pack(self, x: torch.Tensor):
        if self.in_backward or torch._C._current_graph_task_id() != -1 or self.released:
            return Untracked(x)
        w = live_writer(self.writer, storage_key(x)) if x.device.type == self.device_type else None
        if w is None:  # a parameter, a buffer, the batch, a tensor on another device: not the cap's to plan
            if self.midway:  # or made before this step took over: held now, so counted (the model's are not)
                self.memory.track(x)
            return x.detach()
        node = self.nodes[(w.op, w.slot)]
        if node.tensor is None:
            self.residency.hold(node, x.detach())
        node.live += 1
        self.live += 1
        node.last_access = self.residency.clock
        self.residency.make_room(0, pins={node.key})
        return Held(self, node, Geometry.of(x))

    def unpack(self, obj):
        if isinstance(obj, Untracked):
            return obj.unpack()
        if not isinstance(obj, Held):
            return obj
        if self.aborted or self.released:
            raise RegenError("regen.apply: this step was aborted by an exception; its saved tensors are gone")
        self._in_backward()
        self.residency.clock += 1
        op = obj.node.key[0]
        if op < len(self.largest_upto):  # Note [ Headroom in backward ]
            self.largest_bytes = self.largest_upto[op]
            self.residency.headroom_bytes = self._backward_headroom_per_output() * self.largest_bytes
        if self.mode_free:
            self._figures_at_unpack()
        with self.pause():
            base = self.residency.materialize(obj.node)
            self.residency.prefetch(obj.node)
        if self.record is not None:
            self.record.unpack(self.memory.backward_bytes)
        self.unpacks += 1
        with regen_ops():
            return view_of(base, obj.geometry)

    # ---- learning (regen.runtime.learned) ---------------------------------------------------------
    def keep_tail_from(self, op: int) -> None:
        """Keep the captures of ops `op`.. (the loss tail) past the step's release."""
        self._tail_from = op

    def tail_ops(self) -> list:
        """The captured ops from `keep_tail_from`'s op to the end of the forward."""
        if self._tail_ops is not None:
            return self._tail_ops
        return [self.captures[i] for i in range(self._tail_from, self.count)]

    # ---- lifetime ---------------------------------------------------------------------------------
    def _over_cap(self, in_use_bytes: int) -> None:
        """A check found nothing more to drop with `in_use_bytes` (in use, plus what the op about to run needs)
        over the cap: warned past the cap + PEAK_TOLERANCE, as a measured peak is (the op's need is a forecast
        from the step before)."""
        if in_use_bytes <= self.cap_bytes * (1 + PEAK_TOLERANCE):
            return
        self._warn_over_cap(f"{format_bytes(in_use_bytes)} in use passes the cap {format_bytes(self.cap_bytes)} and "
                            f"nothing more can be dropped (parameters, gradients, what the program holds and tensors "
                            f"that cannot be rebuilt stay); this step runs over the cap, its results exact. Raise the "
                            f"cap or lower the batch size")

    def _thrashing(self, replayed_ops: int, forward_ops: int) -> None:
        """The step's rebuilds replayed `replayed_ops` ops against its forward's `forward_ops`: its checks drop
        nothing more (eviction.py, Note [ Thrashing ])."""
        self.stats.thrashing_steps += 1
        warnings.warn(f"regen.apply (dynamic): this step's rebuilds replayed {replayed_ops:,} ops, over "
                      f"{REPLAYS_PER_FORWARD_OP}x the {forward_ops:,} of its forward: each tensor dropped was needed "
                      f"again soon (thrashing), so the step drops nothing more and may pass its cap, its results "
                      f"exact. Raise the cap or lower the batch size", OverCapWarning, stacklevel=3)

    def measured_peak(self, peak_bytes: int) -> None:
        """The allocator measured this step's peak at `peak_bytes` (CUDA: what it allocated inside ops and in
        backward, which the checks at packs and unpacks do not see): warn when it is over the cap + 5%."""
        if peak_bytes > self.cap_bytes * (1 + PEAK_TOLERANCE):
            over = f"{peak_bytes / self.cap_bytes - 1:.0%} " if self.cap_bytes > 0 else ""
            self._warn_over_cap(f"a step peaked at {format_bytes(peak_bytes)} of device memory (the allocator's "
                                f"figure), {over}over the cap "
                                f"{format_bytes(self.cap_bytes)}: what the checks at packs and unpacks cannot see (an "
                                f"op's own temporaries, backward's gradients) or could not drop; its results are "
                                f"exact. Lower the cap or the batch size to stay under it")

    def _warn_over_cap(self, message: str) -> None:
        """One OverCapWarning a step, counted."""
        if self.warned:
            return
        self.warned = True
        self.stats.over_cap_steps += 1
        warnings.warn(f"regen.apply (dynamic): {message}", OverCapWarning, stacklevel=3)

    def handle_died(self, node: TensorNode) -> None:
        """Autograd freed a `Held` of this node."""
        node.live -= 1
        self.live -= 1
        if node.live == 0:
            self.residency.drop(node)
        self.maybe_release()

    def _in_backward(self) -> None:
        """A backward op or an unpack of this step: the first, inside autograd's backward, asks to be told when
        that backward ends (Note [ Counted to the backward's end ])."""
        self.in_backward = True
        if not self.end_awaited and torch._C._current_graph_task_id() != -1:
            self.end_awaited = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self.backward_ended = True
        self.maybe_release()

    def maybe_release(self) -> None:
        """Released once autograd holds none of its handles and its backward is over (or a later step began)."""
        backward_over = self.backward_ended or (self.in_backward and not self.end_awaited)
        if self.live <= 0 and (backward_over or self.closed) and not self.released:
            self.release()

    def release(self, aborted: bool = False) -> None:
        """Let go of everything the step holds: nodes, captures."""
        self.aborted = self.aborted or aborted
        self.released = True
        if self._tail_from is not None and self._tail_ops is None and not self.aborted:
            self._tail_ops = self.tail_ops()
        self.residency.drop_all()
        self.nodes.clear()
        self.captures.clear()
        self.writer.clear()
        self._released_cb(self)
