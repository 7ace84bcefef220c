"""Named RNG streams for model parallelism (Megatron-Core's ``CudaRNGStatesTracker``) and seeding.

A tracker holds one generator state per name. ``fork(name)`` swaps that state into the default
generator of the compute device for the duration of a ``with`` block, so that, for example,
dropout inside tensor-parallel regions differs across TP ranks while dropout outside them is
identical. The class keeps its CUDA name, but on CPU (gloo) it swaps the CPU generator's state.

:func:`model_parallel_cuda_manual_seed` registers Megatron's three streams:
``data-parallel-rng`` = ``seed``, ``model-parallel-rng`` = ``seed + 2718 + tp_rank`` and
``expert-parallel-rng`` = ``seed + 1024 + 100 * ep_rank + etp_rank``; the default device
generator is seeded with ``seed``.

Activation recompute (``checkpoint``, ``CheckpointWithoutOutput``) lives here too, as in
Megatron-Core, because it must save and restore these states so recomputed dropout matches.
While ``checkpoint``'s function runs (its forward and its recomputation) ``is_checkpointing()`` is True.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_core import device, parallel_state
from megatron_core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the RNG stream used inside expert-parallel regions."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the RNG stream that is identical across a model-parallel group."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def _uses_accelerator() -> bool:
    return device.get_current_device().type == "cuda"


def get_rng_state() -> torch.Tensor:
    """State of the compute device's default generator (CUDA on GPU, else the CPU generator)."""
    state = device.get_device_rng_state()
    return state if state is not None else torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    """Restore a state taken by :func:`get_rng_state`."""
    if _uses_accelerator():
        device.set_device_rng_state(state)
    else:
        torch.set_rng_state(state)


def convert_cuda_rng_state(state: torch.Tensor | torch.Generator,
                           to_graphable: bool = False) -> torch.Tensor | torch.Generator:
    """Convert a generator state between its tensor form and its generator form (Megatron-Core's helper).

    ``to_graphable=True``: a state tensor becomes a ``torch.Generator`` of the compute device holding it (a
    generator passes through); otherwise a generator becomes its state tensor (a tensor passes through).
    """
    if isinstance(state, torch.Generator):
        return state if to_graphable else state.get_state()
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"Invalid state type: {type(state)}")
    if not to_graphable:
        return state
    generator = torch.Generator(device=device.get_current_device())
    generator.set_state(state)
    return generator


def is_graph_safe_cuda_rng_tracker(cuda_rng_tracker: object) -> bool:
    """Whether ``cuda_rng_tracker`` keeps its states in the graph-safe form (``torch.Generator`` objects, its
    ``use_cudagraphable_rng``), as Megatron-Core asks before saving or restoring them with
    :func:`convert_cuda_rng_state`. (Megatron-Core also counts Transformer Engine's tracker, which is not used here.)"""
    return bool(getattr(cuda_rng_tracker, "use_cudagraphable_rng", False))


def _seeded_state(seed: int) -> torch.Tensor:
    """The state a default generator of the compute device would have after ``manual_seed(seed)``."""
    generator = torch.Generator(device=device.get_current_device())
    generator.manual_seed(seed)
    return generator.get_state()


class CudaRNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block with that state swapped in.

    Adding the same name or the same seed twice raises, as in Megatron-Core. With ``use_cudagraphable_rng``
    the states are handed out and taken as ``torch.Generator`` objects (Megatron-Core's graph-safe form; see
    :func:`convert_cuda_rng_state`); forking works the same either way (:func:`is_graph_safe_cuda_rng_tracker`).
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        """True once at least one stream was added."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every stream."""
        self._is_initialized = False
        self._current_state_name: str | None = None
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor | torch.Generator]:
        """A copy of the name -> state map (for checkpointing or recompute); generators when graphable."""
        if self.use_cudagraphable_rng:
            return {name: convert_cuda_rng_state(state, to_graphable=True) for name, state in self.states_.items()}
        return {name: state.clone() if isinstance(state, torch.Tensor) else state for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor | torch.Generator]) -> None:
        """Replace the name -> state map (as returned by :meth:`get_states`: tensors or generators)."""
        self._is_initialized = True
        self.states_ = {name: state.get_state() if isinstance(state, torch.Generator)
                        else state.clone() if isinstance(state, torch.Tensor) else state
                        for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Register stream ``name`` seeded with ``seed``."""
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name} already exists in the RNG tracker")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with stream ``name`` as the default generator state, then advance and restore.

        Forks nest: a stream forked inside another continues where it left off and the enclosing one resumes.
        """
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name} is not added to the tracker; call "
                f"tensor_parallel.model_parallel_cuda_manual_seed(seed) after initialize_model_parallel()"
            )
        # Nested forks (as in Megatron-Core): the enclosing stream's progress is saved on entry and resumed on exit.
        original = get_rng_state()
        outer = self._current_state_name
        if outer is not None:
            self.states_[outer] = original
        set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = get_rng_state()
            set_rng_state(self.states_[outer] if outer is not None else original)
            self._current_state_name = outer


class InferenceCudaRNGStatesTracker(CudaRNGStatesTracker):
    """A tracker for inference: ``fork`` does not swap states, since no result depends on them."""

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with the current generator state unchanged."""
        yield


_CUDA_RNG_STATE_TRACKER: CudaRNGStatesTracker | None = None


def _check_supported(use_te_rng_tracker: bool) -> None:
    if use_te_rng_tracker:
        raise ValueError("use_te_rng_tracker=True needs Transformer Engine's RNG tracker, which megatron_core does "
                         "not provide (use_cudagraphable_rng works with this library's tracker)")


def initialize_rng_tracker(
    use_te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    force_reset: bool = False,
) -> None:
    """Create the global tracker if it does not exist (or always, with ``force_reset``)."""
    global _CUDA_RNG_STATE_TRACKER
    _check_supported(use_te_rng_tracker)
    if _CUDA_RNG_STATE_TRACKER is not None and not force_reset:
        return
    tracker_class = InferenceCudaRNGStatesTracker if inference_rng_tracker else CudaRNGStatesTracker
    _CUDA_RNG_STATE_TRACKER = tracker_class(use_cudagraphable_rng=use_cudagraphable_rng,
                                            is_inference_rng_tracker=inference_rng_tracker)


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> CudaRNGStatesTracker:
    """The global RNG tracker, created on first use."""
    initialize_rng_tracker(use_te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    return _CUDA_RNG_STATE_TRACKER


def _expert_ranks() -> tuple[int, int]:
    if parallel_state.get_expert_model_parallel_group(check_initialized=False) is None:
        return 0, 0
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
) -> None:
    """Seed the default device generator with ``seed`` and register the data/model/expert streams.

    Call after ``initialize_model_parallel`` and before building the model. Ranks default to
    this process's ranks in ``parallel_state`` (0 where a group is not set up).
    """
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    default_ep_rank, default_etp_rank = _expert_ranks()
    ep_rank = default_ep_rank if ep_rank is None else ep_rank
    etp_rank = default_etp_rank if etp_rank is None else etp_rank

    initialize_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=True)
    tracker = _CUDA_RNG_STATE_TRACKER
    if _uses_accelerator():
        device.manual_seed_device(seed)
    else:
        torch.random.default_generator.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def get_all_rng_states() -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """CPU generator state, device generator state (``None`` on CPU) and the tracker's states."""
    return torch.get_rng_state(), device.get_device_rng_state(), get_cuda_rng_tracker().get_states()


def set_all_rng_states(states: tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]) -> None:
    """Restore what :func:`get_all_rng_states` returned."""
    cpu_state, device_state, tracker_states = states
    torch.set_rng_state(cpu_state)
    device.set_device_rng_state(device_state)
    get_cuda_rng_tracker().set_states(tracker_states)


IS_CHECKPOINTING = False
"""True while a function wrapped by :func:`checkpoint` runs; read it through :func:`is_checkpointing`."""


def is_checkpointing() -> bool:
    """Whether the code running now is inside :func:`checkpoint` (its forward or its backward recomputation)."""
    return IS_CHECKPOINTING


@contextlib.contextmanager
def _checkpointing() -> Iterator[None]:
    """Set ``IS_CHECKPOINTING`` for the block; the previous value comes back after it (nesting, errors)."""
    global IS_CHECKPOINTING
    previous, IS_CHECKPOINTING = IS_CHECKPOINTING, True
    try:
        yield
    finally:
        IS_CHECKPOINTING = previous


@contextlib.contextmanager
def _rng_states_restored_after() -> Iterator[None]:
    states = get_all_rng_states()
    try:
        yield
    finally:
        set_all_rng_states(states)


def _detach_inputs(inputs: tuple) -> tuple:
    """Detach tensor inputs from the forward graph, keeping their ``requires_grad``."""
    detached = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            leaf = item.detach()
            leaf.requires_grad_(item.requires_grad)
            detached.append(leaf)
        else:
            detached.append(item)
    return tuple(detached)


def _split_saved(args: tuple) -> tuple[list, list]:
    """Tensors (for ``save_for_backward``) and the positional layout of every argument."""
    tensors, layout = [], []
    for item in args:
        if isinstance(item, torch.Tensor):
            layout.append(("t", len(tensors)))
            tensors.append(item)
        else:
            layout.append(("o", item))
    return tensors, layout


def _rebuild(saved: tuple, layout: list) -> tuple:
    return tuple(saved[value] if kind == "t" else value for kind, value in layout)


def _backward_through(outputs, grads) -> None:
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class CheckpointFunction(torch.autograd.Function):
    """Run ``run_function`` without keeping activations; rerun it in backward with the forward's RNG states."""

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_states = get_all_rng_states()
        with torch.no_grad(), _checkpointing():
            outputs = run_function(*args)
        outputs, ctx.passthrough = _detach_passthrough(outputs, args)
        if distribute_saved_activations:
            # Keep only this TP rank's 1-D piece of the first input; backward gathers it again.
            ctx.input_0_shape = args[0].data.shape
            args[0].data = split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True)
        tensors, ctx.layout = _split_saved(args)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() does not support torch.autograd.grad(); use .backward()")
        inputs = _rebuild(ctx.saved_tensors, ctx.layout)
        if ctx.distribute_saved_activations:
            inputs[0].data = gather_split_1d_tensor(inputs[0].data).view(ctx.input_0_shape)
        detached = _detach_inputs(inputs)
        with _rng_states_restored_after(), _checkpointing():
            set_all_rng_states(ctx.rng_states)
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        if ctx.passthrough:  # their gradients reach them through the caller's graph, not through this function
            outputs = tuple(o for i, o in enumerate(_as_tuple(outputs)) if i not in ctx.passthrough)
            grads = tuple(g for i, g in enumerate(grads) if i not in ctx.passthrough)
        _backward_through(outputs, grads)
        input_grads = tuple(item.grad if isinstance(item, torch.Tensor) else None for item in detached)
        return (None, None) + input_grads


def _as_tuple(outputs) -> tuple:
    return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)


def _handed_through(output, inputs: tuple) -> bool:
    """Whether the function returned ``output``, a leaf tensor that requires grad and is not one of its inputs,
    unchanged (a bias parameter returned for a later fused add). Run under ``no_grad``, the tensors the function
    computes do not require grad, and views of its inputs are not leaves of their own (``_base`` is set)."""
    return (isinstance(output, torch.Tensor) and output.requires_grad and output.grad_fn is None
            and output._base is None and not any(output is item for item in inputs))


def _detach_passthrough(outputs, inputs: tuple):
    """The forward's outputs with handed-through leaves (:func:`_handed_through`) detached, and their positions.

    Returned as it is from the autograd function, such a parameter would get the function as its ``grad_fn``: it
    would stop being a leaf and the recomputation would backpropagate into itself without end."""
    if not isinstance(outputs, (torch.Tensor, tuple, list)):
        return outputs, frozenset()
    positions = frozenset(i for i, o in enumerate(_as_tuple(outputs)) if _handed_through(o, inputs))
    if not positions:
        return outputs, positions
    if isinstance(outputs, torch.Tensor):
        return outputs.detach(), positions
    return type(outputs)(o.detach() if i in positions else o for i, o in enumerate(outputs)), positions


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Activation recompute: ``function(*args)`` whose intermediate activations are rebuilt in backward.

    The CPU, device and tracker RNG states of the forward are restored for the recomputation, so
    dropout masks match. With ``distribute_saved_activations`` the saved first argument is split
    across the TP group (each rank keeps 1/TP of it). A parameter the function returns unchanged (a
    ``skip_bias_add`` bias) comes back as itself, its gradient flowing straight to it.
    """
    handed_through: dict[int, torch.Tensor] = {}

    def run(*inner):
        outputs = function(*inner)
        if not torch.is_grad_enabled() and isinstance(outputs, (torch.Tensor, tuple, list)):  # the forward
            handed_through.update((i, o) for i, o in enumerate(_as_tuple(outputs)) if _handed_through(o, inner))
        return outputs

    outputs = CheckpointFunction.apply(run, distribute_saved_activations, *args)
    if not handed_through:
        return outputs
    if isinstance(outputs, torch.Tensor):
        return handed_through[0]
    return type(outputs)(handed_through.get(i, o) for i, o in enumerate(outputs))


class CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward of :class:`CheckpointWithoutOutput`; its backward uses the outputs recomputed by the hook."""

    @staticmethod
    def forward(ctx, run_function, checkpoint_without_output_obj, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        tensors, ctx.layout = _split_saved(_detach_inputs(args))
        ctx.save_for_backward(*tensors)
        checkpoint_without_output_obj.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.recomputed_inputs
        _backward_through(ctx.outputs, grads)
        ctx.outputs = None
        ctx.recomputed_inputs = None
        input_grads = tuple(item.grad if isinstance(item, torch.Tensor) else None for item in inputs)
        return (None, None) + input_grads


class CheckpointWithoutOutput:
    """Recompute that also frees the function's outputs (Megatron's selective recompute helper).

    Usage: ``y = ckpt.checkpoint(fn, x)``; use ``y`` (e.g. ``z = layer(y)``); then
    ``ckpt.discard_output_and_register_recompute(z)`` frees ``y``'s storage. When the gradient of
    ``z`` is computed, ``fn`` is rerun with the forward's RNG states and ``y`` refilled in place,
    before any consumer of ``y`` runs its backward.
    """

    def __init__(self, fp8: bool = False) -> None:
        self.fp8 = fp8
        self.run_function = None
        self.rng_states = None
        self.ctx = None
        self.outputs = None

    def checkpoint(self, run_function, *args):
        """Run ``run_function(*args)`` without keeping its activations; returns its outputs."""
        self.run_function = run_function
        self.rng_states = get_all_rng_states()
        outputs = CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        return outputs

    def _recompute(self, _grad) -> None:
        ctx = self.ctx
        inputs = _detach_inputs(_rebuild(ctx.saved_tensors, ctx.layout))
        with _rng_states_restored_after():
            set_all_rng_states(self.rng_states)
            with torch.enable_grad():
                outputs = self.run_function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        for output, recomputed in zip(self.outputs, outputs):
            storage = output.untyped_storage()
            storage.resize_(recomputed.untyped_storage().size())
            with torch.no_grad():
                storage.copy_(recomputed.untyped_storage())
        ctx.outputs = outputs
        ctx.recomputed_inputs = inputs
        self.run_function = None
        self.rng_states = None
        self.outputs = None
        self.ctx = None

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage; recompute them when ``hook_tensor``'s gradient is computed."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)
