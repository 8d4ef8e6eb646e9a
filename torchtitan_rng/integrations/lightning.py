"""Exact resume for PyTorch Lightning (extra ``lightning``: lightning 2.6, ``import lightning.pytorch as L``).

One change to a user's script: ``ExactResumeCallback()`` joins the Trainer's callbacks. It trains from an
:func:`exact_resume_loader` (a loader with a saved position, its own generator and checkpointed worker
streams; Lightning reads no batch ahead of a loader whose length it knows): the one ``train_dataloader()``
returns, or one made from the plain ``DataLoader`` it returns (same dataset, batch size, workers,
collate_fn, shuffle or not). Then:

* at every checkpoint each rank's loader state (position and that rank's global streams at the step
  boundary) is gathered into the file rank 0 writes (Lightning's loop state holds no loader state: it would
  hold rank 0's only and load it on every rank);
* on resume each rank gets its own back, loaded into the loader at the start of training, before its
  first batch; the streams go back right before that batch is fetched;
* validation during training runs under preserved streams: a run that validates at a step and one that
  resumes from that step's checkpoint (and does not validate again) continue from the same streams;
* for the duration of ``fit()`` the callback owns SIGTERM and SIGUSR1 (Lightning's own SIGTERM handler,
  which stops at the end of the batch without saving and broadcasts from inside the handler, is set
  aside): a signal sets a flag; after the next optimizer step all ranks agree (one all-reduce), save
  ``preempted-step=N.ckpt`` at that step and stop. The handlers found before ``fit()`` are back after it.
  ``fit(ckpt_path="last")`` finds the files of a ``ModelCheckpoint(save_last=True)`` only (Lightning's rule; such
  a one saves its last file at the end of the stopped ``fit()``); a ``fit()`` that loads no checkpoint while the
  folder holds a preempted one says so in one warning naming it: a preempted run is never trained again from
  step 1 silently;
* with ``tensor_fingerprint=True``, per optimizer step and rank, hashes of each micro-batch, its loss, the
  gradients before clipping, the parameters after the update (the optimizer state too where a checkpoint is
  saved), and the state a resume loaded, in ``dump_folder/tensor_fingerprints/`` (docs/diagnosis.md):
  ``compare_losses`` names the first tensor that differs between two runs.
"""

from __future__ import annotations

import json
import signal
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from torchtitan_rng import signals
from torchtitan_rng.config import Debug
from torchtitan_rng.diagnosis.tensor_fingerprints import TensorFingerprints
from torchtitan_rng.distributed import StopVote, rank_and_world_size
from torchtitan_rng.errors import ConfigError
from torchtitan_rng.integrations import check_tested_version
from torchtitan_rng.integrations.loader import EpochLoader, exact_resume_loader
from torchtitan_rng.rng import capture_global_rng, restore_global_rng

check_tested_version("lightning")

__all__ = ["ExactResumeCallback", "exact_resume_loader"]

CHECKPOINT_KEY = "torchtitan_rng_loader_by_rank"


class ExactResumeCallback(L.Callback):
    """Per-rank loader state and streams in every checkpoint, validation that moves no training stream,
    and a save at the agreed step on a signal.

    Args:
        dirpath: where the signal-triggered checkpoint goes (``preempted-step=N.ckpt``); default
            ``<default_root_dir>/checkpoints``. Resume with ``trainer.fit(..., ckpt_path=that file)``.
        seed: the seed of the epoch permutations when ``train_dataloader()`` returns a plain ``DataLoader``;
            default: that loader's ``generator`` seed, else torch's (``L.seed_everything``), which every rank
            must share.

        tensor_fingerprint: record the tensor locator's fingerprints (each micro-batch, its loss, the gradients
            before clipping, the update, what a resume loaded) into ``dump_folder/tensor_fingerprints/``.
        fingerprint_modules_at_step: with ``tensor_fingerprint``, at this optimizer step also hash every module
            call's inputs and outputs (up to the step's clipping); 0: none.
        fingerprint_optimizer_every_step: with ``tensor_fingerprint``, hash the optimizer state after every
            step's update, not only at saves and where training starts (with AdamW, twice the bytes a step hashes).
        dump_folder: where the fingerprints go, beside the run's loss log; default ``default_root_dir``.

    After ``fit()``, ``preempted_checkpoint`` is the path of that checkpoint when a signal stopped the run
    (``None`` otherwise): a script can tell a preempted ``fit()`` from a finished one.
    """

    def __init__(self, dirpath: str | Path | None = None, seed: int | None = None, *,
                 tensor_fingerprint: bool = False, fingerprint_modules_at_step: int = 0,
                 fingerprint_optimizer_every_step: bool = False, dump_folder: str | Path | None = None) -> None:
        if fingerprint_modules_at_step < 0:
            raise ConfigError(f"ExactResumeCallback fingerprint_modules_at_step={fingerprint_modules_at_step}: it "
                              "must be >= 0")
        debug = Debug(tensor_fingerprint=True, fingerprint_modules_at_step=fingerprint_modules_at_step,
                      fingerprint_optimizer_every_step=fingerprint_optimizer_every_step)
        self._prints = _Fingerprints(debug, dump_folder) if tensor_fingerprint else None
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.seed = seed
        self.preempted_checkpoint: Path | None = None
        self._loaders: list[EpochLoader] = []
        self._vote: StopVote | None = None
        self._signals: ExitStack | None = None
        self._unheeded: signals.Scope | None = None
        self._streams_before_validation: dict[str, Any] | None = None
        self._to_load: list[dict[str, Any]] | None = None  # this rank's loader state from the checkpoint
        self._resumed = False  # this fit() loaded a checkpoint

    # -- start and end of training -------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before fit() asks for its train loader: a plain DataLoader becomes an exact one.
        source = trainer.fit_loop._data_source
        if stage == "fit" and not isinstance(source.dataloader, _ExactRequest):
            source.dataloader = _ExactRequest(source.dataloader, self.seed)
        self._resumed = False

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._own_signals(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._loaders = _epoch_loaders(trainer)  # kept for teardown, when Lightning has let go of them
        if len(self._loaders) != 1 or len(trainer.fit_loop._combined_loader.flattened) != 1:
            raise ConfigError("ExactResumeCallback needs one train loader: train_dataloader() returned several")
        self._own_signals(trainer)
        if self._to_load is not None:  # before the first batch: the loader has not been iterated yet
            self._loaders[0].load_state_dict(self._to_load[0])
            self._to_load = None
        self.preempted_checkpoint = None
        if not self._resumed:
            self._warn_if_preempted(trainer)
        self._vote = StopVote()  # every rank starts training here, with its process group up
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        if not isinstance(val_loop.run, _PreservingStreams):
            val_loop.run = _PreservingStreams(val_loop.run, vars(val_loop).get("run"), self, self._loaders[0].device)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The fingerprints stay open until teardown: ModelCheckpoint's save_last runs after this hook (Lightning
        # puts checkpoint callbacks last), and its save adds the optimizer state to the last step's line.
        # The vote cast at the last step (every rank has one in flight): a signal during it is saved here.
        if self._vote is not None and self._vote.close():
            self._save_preempted(trainer)
        self._vote = None
        self._release_signals()
        _unwrap_validation(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._vote = None  # another rank may never cast the vote in flight: not waited for
        self._release_signals(failed=True)
        _unwrap_validation(trainer)
        self._loaders += _epoch_loaders(trainer)
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._prints is not None:
            self._prints.close()  # what is queued is written, also after a failure
        # The loader's workers ignore the checkpoint signals, so exit-time termination cannot end them.
        for loader in self._loaders:
            loader.close()
        self._loaders = []
        # Now that Lightning has put back the handlers found before fit(): a signal training did not act on
        # goes to them (by default it ends the process; never a normal-looking end without the checkpoint).
        unheeded, self._unheeded = self._unheeded, None
        if unheeded is not None:
            unheeded.redeliver()

    def _own_signals(self, trainer: L.Trainer) -> None:
        """Take SIGTERM/SIGUSR1 from Lightning's handler (installed at ``fit()`` start, after the checkpoint is
        restored) until the end of training; the one found before ``fit()`` comes back then."""
        if self._signals is not None:
            return
        self._signals = ExitStack()
        # Not redelivered at the end of training: Lightning's handler (back then) broadcasts from inside itself.
        self._unheeded = self._signals.enter_context(signals.handling(redeliver=False))
        if trainer._signal_connector.received_sigterm:  # Lightning's handler had one: ours from now on
            trainer._signal_connector.received_sigterm = False
            signal.raise_signal(signal.SIGTERM)

    def _release_signals(self, *, failed: bool = False) -> None:
        stack, self._signals = self._signals, None
        if stack is None:
            return
        if failed:  # an error ends fit(): it is what the process reports, not a pending signal
            signals.acknowledge()
        stack.close()
        if failed:
            self._unheeded = None

    # -- checkpoints -----------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self._prints is not None and self._prints.prints is not None:
            self._prints.prints.saving(trainer.global_step)  # with the optimizer state the checkpoint holds
        loaders = _epoch_loaders(trainer)  # during training, or after it (its end position)
        if not loaders:  # saved before any training: there is no loader position to keep
            return
        mine = [loader.state_dict() for loader in loaders]
        if self._streams_before_validation is not None:  # saved inside validation: the boundary's streams
            mine = [{**state, "rng": self._streams_before_validation} for state in mine]
        _, world = rank_and_world_size()
        by_rank: list[Any] = [mine]
        if world > 1:  # a collective: Lightning builds the checkpoint on every rank, rank 0 writes it
            by_rank = [None] * world
            dist.all_gather_object(by_rank, mine)
        checkpoint[CHECKPOINT_KEY] = by_rank

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != "fit":  # validate/test/predict from a checkpoint: no loader to restore
            return
        by_rank = checkpoint.get(CHECKPOINT_KEY)
        rank, world = rank_and_world_size()
        if by_rank is None:
            raise ValueError("this checkpoint was saved without ExactResumeCallback: it holds no per-rank loader "
                             "state; resume it without the callback (inexactly) or from one saved with it")
        if len(by_rank) != world:
            raise ValueError(f"this checkpoint holds the loaders of {len(by_rank)} ranks and this run has {world}: "
                             f"resume with {len(by_rank)} processes for an exact resume")
        self._to_load = by_rank[rank]  # loaded into the train loader at the start of training
        self._resumed = True

    # -- the stop on a signal ----------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._prints is not None:
            self._prints.batch(trainer, pl_module, batch)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._prints is not None and self._prints.prints is not None:
            self._prints.prints.gradients()  # Lightning clips after this hook

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._prints is not None:
            self._prints.batch_end(trainer, outputs)
        # At optimizer steps only, the same ones on every rank; the vote is read one step later, never waited for.
        if trainer.fit_loop._should_accumulate() or self._vote is None:
            return
        if self._vote.poll(signals.received() is not None):
            self._vote.close()  # the vote cast with it: the same signal, already acted on
            self._vote = None
            self._save_preempted(trainer)
            trainer.should_stop = True

    def _folder(self, trainer: L.Trainer) -> Path:
        return self.dirpath or Path(trainer.default_root_dir) / "checkpoints"

    def _save_preempted(self, trainer: L.Trainer) -> None:
        path = self._folder(trainer) / f"preempted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)  # a collective: every rank is here at the same step
        self.preempted_checkpoint = path
        signals.acknowledge()

    def _warn_if_preempted(self, trainer: L.Trainer) -> None:
        """A fit() that loaded no checkpoint beside a preempted one (``ckpt_path`` left out, or ``"last"`` with
        no ModelCheckpoint keeping a last file): one warning naming it, as its steps are about to be trained
        again from the start."""
        found = sorted(self._folder(trainer).glob("preempted-step=*.ckpt"), key=lambda path: path.stat().st_mtime)
        if found:
            rank_zero_warn(f"{found[-1]} holds a preempted run and this fit() loaded no checkpoint: it trains from "
                           f"step 1; to resume it pass ckpt_path=\"{found[-1]}\" (ckpt_path=\"last\" finds it only "
                           "through a ModelCheckpoint(save_last=True))")


class _Fingerprints:
    """``tensor_fingerprint``: the recorder, built at the first batch (the optimizer exists then, and a resume has
    loaded); each optimizer step begins at its first micro-batch and ends, recorded, after its update."""

    def __init__(self, debug: Debug, dump_folder: str | Path | None) -> None:
        self.debug, self.dump_folder = debug, dump_folder
        self.prints: TensorFingerprints | None = None

    def batch(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        if self.prints is None:
            config = {"trainer.gradient_clip_val": trainer.gradient_clip_val,
                      "trainer.gradient_clip_algorithm": trainer.gradient_clip_algorithm,
                      "trainer.accumulate_grad_batches": trainer.accumulate_grad_batches,
                      **{f"hparams.{key}": value for key, value in pl_module.hparams.items()}}
            self.prints = TensorFingerprints(
                self.debug, pl_module, trainer.optimizers[0] if trainer.optimizers else None, rank=trainer.global_rank,
                world_size=trainer.world_size,
                dump_folder=Path(self.dump_folder if self.dump_folder is not None else trainer.default_root_dir),
                config=json.loads(json.dumps(config, default=repr)))
        if self.prints.record.get("step") != trainer.global_step + 1:  # the step's first micro-batch
            self.prints.step_begin(trainer.global_step + 1)
        self.prints.batch(batch)

    def batch_end(self, trainer: L.Trainer, outputs: Any) -> None:
        if self.prints is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.prints.loss(loss)  # this rank's micro-batch loss, before any reduction over ranks
        if trainer.global_step == self.prints.record.get("step"):  # the optimizer stepped: the update is done
            self.prints.updated(flush=False)

    def close(self) -> None:
        if self.prints is not None:
            self.prints.close()
            self.prints = None


def _as_exact_loader(loader: Any, seed: int | None) -> Any:
    """``loader`` as an :class:`EpochLoader`: itself, or one made from a plain ``DataLoader`` over a map-style
    dataset with the stock samplers (a custom sampler's order cannot be carried over exactly)."""
    if isinstance(loader, EpochLoader):
        return loader
    # A DataLoader subclass is refused too: what it adds would be lost in the loader made from it.
    if (type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset)
            or type(loader.sampler) not in (RandomSampler, SequentialSampler)
            or type(loader.batch_sampler) is not BatchSampler):
        raise ConfigError("ExactResumeCallback trains from a DataLoader (not a subclass) over a map-style dataset with "
                         "shuffle=True or False and no sampler of its own; return torchtitan_rng.integrations.lightning."
                         "exact_resume_loader(dataset, batch_size=..., seed=...) from train_dataloader() instead")
    if seed is None:
        seed = loader.generator.initial_seed() if loader.generator is not None else torch.initial_seed()
        _, world = rank_and_world_size()
        seeds: list[Any] = [seed] * world
        if world > 1:
            dist.all_gather_object(seeds, seed)
        if len(set(seeds)) > 1:
            raise ConfigError(f"the ranks' seeds differ ({seeds}): call L.seed_everything(seed) before fit(), or pass "
                             "ExactResumeCallback(seed=...), so that every rank shares the epoch permutations")
    return exact_resume_loader(loader.dataset, batch_size=loader.batch_size, seed=seed,  # type: ignore[arg-type]
                               num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                               shuffle=isinstance(loader.sampler, RandomSampler),
                               prefetch_factor=loader.prefetch_factor or 2)


class _ExactRequest:
    """Lightning's request for the train loader, answered with an exact one (an object, not a closure: a Trainer
    pickles)."""

    def __init__(self, request: Callable[[], Any], seed: int | None) -> None:
        self.request, self.seed = request, seed

    def __call__(self) -> Any:
        loaders = self.request()
        # Lightning calls this inside a context that patches DataLoader.__setattr__ and puts it back only when
        # no exception leaves it: raised here, a refusal would leave every later DataLoader of the process
        # recording its attributes (our loaders' live iterators among them, which a pickled Trainer then
        # reaches). Handed back instead, it is raised at the loader's first iter(), right after the request.
        try:
            return self._exact(loaders)
        except ValueError as refusal:
            return _Refused(refusal)

    def _exact(self, loaders: Any) -> Any:
        # One loader in a list, tuple or dict: the same container, so that batches keep their shape.
        if isinstance(loaders, (list, tuple)) and len(loaders) == 1:
            return type(loaders)([_Batches(_as_exact_loader(loaders[0], self.seed))])
        if isinstance(loaders, dict) and len(loaders) == 1:
            return {key: _Batches(_as_exact_loader(loader, self.seed)) for key, loader in loaders.items()}
        return _Batches(_as_exact_loader(loaders, self.seed))


class _Refused:
    """The train loader in place of one the callback refused: iterating it raises the refusal."""

    def __init__(self, refusal: ValueError) -> None:
        self.refusal = refusal

    def __iter__(self) -> Any:
        raise self.refusal


class _Batches:
    """What Lightning iterates: the exact loader without ``state_dict``, so that Lightning keeps no loader state of
    its own (it would keep rank 0's only, in its loop state); the callback saves every rank's."""

    def __init__(self, loader: EpochLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> EpochLoader:
        return self.loader


class _PreservingStreams:
    """The validation loop's ``run`` inside fit, with every global stream as it was before it: a checkpoint saved
    before or during it holds the streams of the step boundary. (An object, not a closure: a Trainer pickles.)"""

    def __init__(self, run: Callable[[], Any], instance_run: Callable[[], Any] | None, callback: ExactResumeCallback,
                 device: torch.device) -> None:
        # instance_run: a ``run`` set on the loop object itself (None: the class's), put back at the end.
        self.run, self.instance_run, self.callback, self.device = run, instance_run, callback, device

    def __call__(self) -> Any:
        self.callback._streams_before_validation = streams = capture_global_rng(self.device)
        try:
            return self.run()
        finally:
            restore_global_rng(streams, self.device)
            self.callback._streams_before_validation = None


def _unwrap_validation(trainer: L.Trainer) -> None:
    """The validation loop's own ``run`` back, at the end of training."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    wrapper = vars(val_loop).get("run")
    if isinstance(wrapper, _PreservingStreams):
        if wrapper.instance_run is None:
            del val_loop.run
        else:
            val_loop.run = wrapper.instance_run


def _epoch_loaders(trainer: L.Trainer) -> list[EpochLoader]:
    combined = trainer.fit_loop._combined_loader
    return [it.loader for it in (combined.flattened if combined is not None else []) if isinstance(it, _Batches)]
