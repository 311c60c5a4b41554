"""regen's entries on the thread's stacks: saved-tensor hooks and torch modes, which only pop from the top.

Autograd's default saved-tensor hooks, the dispatch modes and the torch function modes are per-thread
stacks. A step's hooks cannot be popped from inside backward (the engine restores the thread's hook
stack when a backward returns), so they stay pushed after the step's forward until the next step begins
or the handle is removed; the dispatch modes of plans with recipes and of dynamic mode stay pushed
through backward too. With several handles in one thread (two models trained in turn, a teacher and a
student, a GAN's two networks), another handle's entries may lie above them when their owner lets them
go. So:

* a step's hooks are pushed with `push_hooks` and popped with `pop_hooks` when they are on top;
  `pop_finished` pops, from the top down, the hooks of every regen step that packs no more
  (`packs_no_more()`: its saved set is final), whichever handle it belongs to;
* a mode its owner lets go while it is not on top is `orphan`ed, and `pop_finished` pops orphaned modes
  once they are on top;
* a torch function mode of regen's (a pass-through watcher: dynamic mode's backward gate, a recorder's
  watcher, a tracker's closer) its owner lets go is `take_out`: removed from the stack wherever it is,
  the modes above it pushed back in their order. Two handles' steps in turn keep each other's watchers
  off the top: popped only once on top, they would stay, one more per step, and every torch call of the
  program would pass through each in Python;
* a dispatch mode pushed with `push_mode(mode, done)` (dynamic mode's: it must see its step's backward,
  which runs after the model returned) is popped by `pop_finished` once it is on top and `done()`: its
  owner needs it no more until it pushes it again. Left pushed, every op of the program between two of
  its steps (an optimizer step, another model's step) would pass through it in Python;
* every step start and every `remove()` calls `pop_finished`, so the stacks do not grow from step to
  step, and what could not be popped is popped as soon as it is on top again (after the last handle's
  `remove()`, nothing of regen's is left on them);
* a context manager's exit pops the top of the hook stack, whatever it is: a user's
  `saved_tensors_hooks` (`save_on_cpu`, ...) entered around a training step exits after backward,
  while the step's hooks are still on top, and takes them instead of its own. `pop_finished` first
  finds such steps (their hooks gone from the stack) and takes out of the stack the hooks that were
  right below them when they were pushed: what that exit meant to pop (the entries above are pushed
  back in their order). Without this, the user's hooks stayed pushed for the rest of the process, one
  more per step (save_on_cpu offloading every later tensor of the process).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.overrides import _get_current_function_mode, _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack


class HookedStep(Protocol):
    def packs_no_more(self) -> bool: ...


# pack hook -> its step, while pushed (the stack holds the hooks, and so the steps, as strongly)
_pushed: dict[Callable, HookedStep] = {}
_below: dict[Callable, Callable | None] = {}  # pack hook -> the pack hook on top when it was pushed
_orphans: list = []  # modes let go by their owners while other modes were above them
_done_when: list[tuple[object, Callable[[], bool]]] = []  # push_mode's modes, each with its done()


def push_hooks(step: HookedStep, pack: Callable, unpack: Callable) -> None:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    _pushed[pack] = step
    _below[pack] = top[0] if top is not None else None


def hooks_pushed(pack: Callable) -> bool:
    return pack in _pushed


def pop_hooks(pack: Callable) -> None:
    """Pop the hooks of `pack` when they are on top of the stack (else `pop_finished` pops them later)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and top[0] == pack and pack in _pushed:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        _forget(pack)


def push_mode(mode, done: Callable[[], bool]) -> None:
    """Push dispatch mode `mode`, to be popped once it is on top and `done()` (or let go by `let_go`)."""
    mode.__enter__()
    _done_when.append((mode, done))


def mode_pushed(mode) -> bool:
    """`mode` was pushed by `push_mode` and is neither popped nor let go."""
    return any(m is mode for m, _ in _done_when)


def let_go(mode) -> None:
    """A `push_mode` mode its owner no longer wants: popped now when on top, else orphaned."""
    if not mode_pushed(mode):
        return
    _done_when[:] = [(m, d) for m, d in _done_when if m is not mode]
    if _get_current_dispatch_mode() is mode:
        mode.__exit__(None, None, None)
    else:
        orphan(mode)


def orphan(mode) -> None:
    """`mode` (a dispatch or function mode, not on top) is no longer wanted: popped once it is on top;
    nothing to do when it is on neither of this thread's stacks."""
    on_stack = (any(m is mode for m in _get_current_dispatch_mode_stack())
                or any(m is mode for m in _get_current_function_mode_stack()))
    if on_stack and not any(m is mode for m in _orphans):
        _orphans.append(mode)


def take_out(mode) -> None:
    """`mode`, a torch function mode that only watches calls, is no longer wanted: removed from this thread's
    function-mode stack wherever it is (nothing to do when it is not on it)."""
    if not any(m is mode for m in _get_current_function_mode_stack()):
        return
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    _orphans[:] = [m for m in _orphans if m is not mode]


def pop_finished() -> None:
    """Pop, from the top down, the hooks of regen steps that pack no more and the orphaned modes (after
    undoing what a foreign exit that took a step's hooks meant to pop)."""
    _undo_foreign_pops()
    while _pop_finished_hooks() or _pop_orphan(_get_current_dispatch_mode()) \
            or _pop_done_mode(_get_current_dispatch_mode()) or _pop_orphan(_get_current_function_mode()):
        pass


def _pop_finished_hooks() -> bool:
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    try:
        step = _pushed.get(top[0]) if top is not None else None
    except TypeError:  # someone else's hook, not hashable: not regen's
        return False
    if step is None or not step.packs_no_more():
        return False
    torch._C._autograd._pop_saved_tensors_default_hooks()
    _forget(top[0])
    return True


def _forget(pack: Callable) -> None:
    del _pushed[pack]
    _below.pop(pack, None)


def _hook_stack() -> list[tuple]:
    """This thread's saved-tensor hooks, bottom first (popped and pushed back: there is no reader)."""
    popped = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
        popped.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in reversed(popped):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return popped[::-1]


def _undo_foreign_pops() -> None:
    """Steps whose hooks someone else popped: forget them, and take out of the stack what that pop
    meant to take (the hooks right below theirs when they were pushed), wherever it now is; the
    entries above it are pushed back in their order. The stack is read once (it has no reader: popped
    and pushed back), and rebuilt only when something is taken out."""
    if not _pushed:
        return
    stack = _hook_stack()
    on_stack = {id(pack) for pack, _ in stack}  # the very objects push_hooks pushed
    gone = [p for p in _pushed if id(p) not in on_stack]
    meant = set()  # ids of the entries those pops meant to take
    for pack in gone:
        below = _below.get(pack)
        _forget(pack)
        if below is not None and not any(below is p for p in _pushed):  # never another step's hooks
            meant.add(id(below))
    keep = stack[:]
    for i in range(len(stack) - 1, -1, -1):  # the topmost entry of each, as a LIFO exit would take
        if id(stack[i][0]) in meant:
            meant.discard(id(stack[i][0]))
            del keep[i]
    if len(keep) == len(stack):
        return
    for _ in stack:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    for pack, unpack in keep:
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _pop_done_mode(mode) -> bool:
    for m, done in _done_when:
        if m is mode:
            if not done():
                return False
            let_go(mode)
            return True
    return False


def _pop_orphan(mode) -> bool:
    if mode is None or not any(m is mode for m in _orphans):
        return False
    mode.__exit__(None, None, None)
    _orphans[:] = [m for m in _orphans if m is not mode]
    return True
