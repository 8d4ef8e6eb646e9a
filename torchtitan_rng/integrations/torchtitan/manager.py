"""torchtitan's DCP checkpoint manager with every rank's streams, a save-and-stop on signals, the loss log, the tensor
fingerprints, the run record and the save-time checks; what the override (``exact_resume``) puts in the run's
config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchtitan.components.checkpointer import TRAIN_STATE, CheckpointManager
from torchtitan.tools.logging import logger

from torchtitan_rng import signals as checkpoint_signals
from torchtitan_rng.checkpoint.layout import rank_key
from torchtitan_rng.checkpoint.run_record import make_record, read_record, write_record
from torchtitan_rng.checkpoint.safe_load import SafeFileSystemReader
from torchtitan_rng.checkpoint.train_state import TrainState
from torchtitan_rng.config import Debug
from torchtitan_rng.distributed import rank_and_world_size
from torchtitan_rng.diagnosis.tensor_fingerprints import TensorFingerprints
from torchtitan_rng.integrations.torchtitan.drift import config_drift, config_values
from torchtitan_rng.integrations.torchtitan.fingerprints import attach_tensor_fingerprints
from torchtitan_rng.integrations.torchtitan.layout import layout_change, layout_of, saved_stream_ranks
from torchtitan_rng.integrations.torchtitan.loss_log import attach_loss_log
from torchtitan_rng.integrations.torchtitan.mask_groups import check_mask_groups, mask_groups
from torchtitan_rng.integrations.torchtitan.options import check_options
from torchtitan_rng.integrations.torchtitan.seed import unseeded_run
from torchtitan_rng.integrations.torchtitan.stop import SignalStop
from torchtitan_rng.integrations.torchtitan.streams import (STREAMS_PART, _PreservedStreamsValidator,
                                                            _RestoreAfterIter)
from torchtitan_rng.integrations.torchtitan.workers import carry_worker_streams


class ExactResumeCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpoint manager, with every rank's streams and a save-and-stop on signals."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        signals: list[str] = field(default_factory=lambda: list(checkpoint_signals.DEFAULT_SIGNALS))
        """Signals that save a full checkpoint at an agreed step and end the run (exit 0)."""

        restore_streams_at: Literal["first_iter", "load"] = "first_iter"
        """``first_iter``: after ``iter(dataloader)`` (exact). ``load``: inside the checkpoint load, one
        ``_base_seed`` draw too early; there only to show that the restore point matters."""

        worker_streams: bool = True
        """Carry each loader worker's streams in the loader's per-worker state (``--dataloader.num_workers``
        > 0). ``False`` leaves them to the loader's seed (named at start); only to show that they matter."""

        tensor_fingerprint: bool = False
        """Record the tensor locator's fingerprints (each micro-batch, its loss, the gradients before clipping,
        the update, what a resume loaded) into ``dump_folder/tensor_fingerprints/``: ``compare_losses`` names the
        first tensor that differs between two runs (``fingerprints``)."""

        fingerprint_modules_at_step: int = 0
        """With ``tensor_fingerprint``, at this step also hash every module call's inputs and outputs (0: none)."""

        fingerprint_optimizer_every_step: bool = False
        """With ``tensor_fingerprint``, hash the optimizer state after every step's update, not only at saves and
        where a process starts (with AdamW, twice the bytes a step hashes)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            # The override checks its options before building this; a config built in code, here.
            check_options({"signals": self.signals, "restore_streams_at": self.restore_streams_at,
                           "worker_streams": self.worker_streams, "tensor_fingerprint": self.tensor_fingerprint,
                           "fingerprint_modules_at_step": self.fingerprint_modules_at_step,
                           "fingerprint_optimizer_every_step": self.fingerprint_optimizer_every_step})

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # The trainer has built its metrics processor; the loss log is written with checkpoints off too.
        trainer = kwargs["states"][TRAIN_STATE]
        self.loss_log = attach_loss_log(trainer)
        self.prints: TensorFingerprints | None = (
            attach_tensor_fingerprints(trainer, Debug(
                tensor_fingerprint=True, fingerprint_modules_at_step=config.fingerprint_modules_at_step,
                fingerprint_optimizer_every_step=config.fingerprint_optimizer_every_step))
            if config.tensor_fingerprint else None)  # off: nothing hooked
        unseeded = unseeded_run(trainer.config.debug.seed)
        if unseeded is not None and rank_and_world_size()[0] == 0:
            logger.warning(unseeded)
        super().__init__(config, **kwargs)
        if not self.enable:
            if rank_and_world_size()[0] == 0:
                logger.warning("torchtitan_rng: checkpointing is off (--checkpoint.enable): no random "
                               "streams are saved and stop signals are not handled")
            return
        self.restore_streams_at = config.restore_streams_at
        self.trainer = self.states[TRAIN_STATE]
        self.streams = TrainState(self.trainer.device)
        self.states[STREAMS_PART] = self.streams
        self._restore_pending = False
        self._stop_step: int | None = None
        self.stop: SignalStop | None = SignalStop(config.signals)  # a collective: every rank builds its manager here
        self._mask_groups = mask_groups(self.trainer.parallel_dims)
        line = carry_worker_streams(self.trainer.dataloader, config.worker_streams)
        if line is not None and self.streams.rank == 0:
            logger.warning(line)
        # The loop iterates trainer.dataloader; the checkpoint keeps the loader itself (states["dataloader"]).
        self.trainer.dataloader = _RestoreAfterIter(self.trainer.dataloader, self.restore_streams)

    def load(self, step: int = -1) -> bool:
        """The stock load (the first thing ``train()`` does); the streams go back at ``iter(dataloader)``."""
        if not self.enable:
            return False
        validator = getattr(self.trainer, "validator", None)  # built after this manager
        if validator is not None and not isinstance(validator, _PreservedStreamsValidator):
            self.trainer.validator = _PreservedStreamsValidator(validator, self.trainer.device)
        self.streams.loaded = None
        loaded = self._load(step)
        self._restore_pending = self.streams.loaded is not None
        if self.restore_streams_at == "load":
            self.restore_streams()
        return loaded

    def restore_streams(self) -> None:
        """Put this rank's loaded streams back (once); the device's only when saved from the same device type."""
        if not self._restore_pending:
            return
        self._restore_pending = False
        saved_device = self.streams.loaded["device_type"]
        same_device = saved_device == self.trainer.device.type
        if not same_device and rank_and_world_size()[0] == 0:
            logger.warning(f"torchtitan_rng: the checkpoint's streams were saved on {saved_device} and this run "
                           f"trains on {self.trainer.device.type}: the device stream starts fresh, so the resume "
                           "is not exact")
        self.streams.restore_rng(include_device=same_device)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if STREAMS_PART in self.exclude_from_loading and not from_hf and self.streams.rank == 0:
            logger.warning(f"torchtitan_rng: --checkpoint.exclude_from_loading names {STREAMS_PART}: every rank "
                           "resumes with the streams torchtitan seeded at start, so this resume is not exact")
        if STREAMS_PART in state_dict and not from_hf:
            record = read_record(Path(checkpoint_id)) if self.streams.rank == 0 else None
            keys = SafeFileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            saved = saved_stream_ranks(keys)
            if self.streams.rank == 0:  # before the load: torchtitan's dataloader may refuse another dp degree
                self._check_drift(record)
                saved_layout = (record or {}).get("layout")
                saved_layout = saved_layout if isinstance(saved_layout, dict) else None  # older: not recorded
                line = (layout_change(saved, saved_layout, self.streams.world_size,
                                      layout_of(self.trainer.parallel_dims)) if saved else
                        f"torchtitan_rng: checkpoint {checkpoint_id} holds no random streams (saved without "
                        "torchtitan_rng): resuming with fresh random streams, so this resume is not exact")
                if line is not None:
                    logger.warning(line)
            if f"{STREAMS_PART}.{rank_key(self.streams.rank)}" not in keys:
                # DCP raises on a key the checkpoint lacks: this rank loads without streams (named above).
                state_dict = {name: part for name, part in state_dict.items() if name != STREAMS_PART}
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    def _check_drift(self, saved: dict[str, Any] | None) -> None:
        """Name every changed key that can change the losses (a checkpoint without a record has none)."""
        if saved is None:
            return
        layout_recorded = isinstance(saved.get("layout"), dict)
        for line in config_drift(saved["config"], config_values(self.trainer.config), layout_recorded):
            logger.warning(f"torchtitan_rng: {line}: this resume is no longer the run that was stopped")

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """Called after every step's update, with checkpointing on or off: the update's fingerprints first."""
        if self.prints is not None:
            self.prints.updated(flush=False)  # read at the next logged step's log, or at a save (``_save``)
        return super().save(curr_step, last_step)

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        return curr_step == self._stop_step or super()._should_save(curr_step, last_step)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Called after every step: the stock save, or on an agreed stop signal a full save and the end."""
        self.streams.step = curr_step
        assert self.stop is not None
        stopping = self.stop.agreed()
        if self.prints is not None and (stopping or self._should_save(curr_step, last_step)):
            # With the optimizer state the checkpoint holds; written now (a save reads the device anyway): a kill
            # after the save loses no recorded step.
            self.prints.saving(curr_step)
        if not stopping:
            if self._should_save(curr_step, last_step):
                check_mask_groups(curr_step, self._mask_groups, self.trainer.device)
            self._write_record(curr_step, last_step)
            return super()._save(curr_step, last_step)
        self._stop_step = curr_step
        check_mask_groups(curr_step, self._mask_groups, self.trainer.device)
        self._write_record(curr_step, False)
        saved = super()._save(curr_step, last_step=False)  # last_step would save the model only by default
        self.maybe_wait_for_saving()
        logger.info(f"torchtitan_rng: stop signal: saved a full checkpoint at step {curr_step}; stopping")
        self.trainer.config.training.steps = curr_step  # the loop ends after this step
        return saved

    def _write_record(self, step: int, last_step: bool) -> None:
        """Rank 0 puts the run record into the folder of a checkpoint about to be saved (before DCP writes
        ``.metadata``, which is what makes torchtitan count the folder as a checkpoint)."""
        if self.streams.rank != 0 or not self._should_save(step, last_step):
            return
        folder = Path(self._create_checkpoint_id(step))
        folder.mkdir(parents=True, exist_ok=True)
        record = make_record(config_values(self.trainer.config), None)
        record["layout"] = layout_of(self.trainer.parallel_dims)  # named at a resume on another layout
        write_record(folder, record)

    def close(self) -> None:
        """Also with checkpointing off (the stock close then does nothing)."""
        if getattr(self, "prints", None) is not None:
            self.prints.close()
            self.prints = None
        super().close()

    def _close(self) -> None:
        if getattr(self, "stop", None) is not None:
            self.stop.close()
            self.stop = None
        if getattr(self, "loss_log", None) is not None:
            self.loss_log.close()
            self.loss_log = None
        super()._close()
