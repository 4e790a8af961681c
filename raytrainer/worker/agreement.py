"""A decision taken on one rank (stop, save, evaluate, log) becomes every rank's, in the same step.

Every rank calls the callbacks, and a callback may decide differently on different ranks (a stop asked on
rank 1 only, a flag polled from the driver on rank 0). transformers' loop acts on each rank's own flags: the
rank that stops leaves the others waiting in the next step's all-reduce, a save asked on one rank is a
collective the others never enter. raytrainer's loop (worker/loop.py) ORs the flags across ranks after each
event whose flags it reads next; a hosted trainer's loop (transformers', or TRL's) gets the same through its
``CallbackHandler`` (``agree_on_flags``): after each such event of a training run, one all-reduce of one
int32 tensor of the five flags.

Only where some callback may decide differently on different ranks (``callbacks.same_on_every_rank``): a run
whose callbacks never write a flag, or write the same one on every rank (transformers' flow and
early-stopping callbacks), pays nothing.
"""

from __future__ import annotations

from raytrainer.callbacks import _BASE_HOOKS, TrainerControl, same_on_every_rank

FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")

#: transformers' loop reads the flags after these events of a training run (Trainer._inner_training_loop,
#: _maybe_log_save_evaluate): stop after each step, micro-batch and epoch; evaluate and save after on_log;
#: save after on_evaluate; stop after on_save.
AGREED_EVENTS = frozenset({"on_step_end", "on_substep_end", "on_epoch_end", "on_log", "on_evaluate",
                           "on_save"})


def sync_control(control: TrainerControl, ctx, busy: bool = False) -> bool:
    """Each flag of ``control`` set where any rank set it. ``busy`` rides along (a rank still writing its
    checkpoint part); returns whether any rank is."""
    values = ctx.any_flags([getattr(control, f) for f in FLAGS] + [busy])
    for name, value in zip(FLAGS, values):
        setattr(control, name, value)
    return values[-1]


def must_agree(callbacks, ctx) -> bool:
    """Whether the ranks must agree on the flags: distributed, and some callback may decide differently on
    different ranks."""
    return ctx.distributed and not all(same_on_every_rank(cb) for cb in callbacks)


class AgreeingHandler:
    """Mixed into a hosted trainer's ``CallbackHandler`` class (``agree_on_flags``). Between
    ``on_train_begin`` and ``on_train_end`` (every rank runs those events in lock step), each event in
    ``AGREED_EVENTS`` ends with the ranks' flags OR-ed; outside training transformers reads no flag."""

    _agreement_ctx = None
    _agreeing = False
    #: raytrainer's own callbacks (``add_to_layer``): called after the listed ones at each event, and not
    #: listed in ``callbacks``, which stays what transformers and the user put there
    layer: tuple = ()

    #: per event, the layer's hooks that do something (not TrainerCallback's own), for ``_hooks_of``
    _hooks: dict = {}
    _hooks_for: tuple | None = None

    def _hooks_of(self, event: str) -> list:
        if self._hooks_for is not self.layer:  # add_to_layer / remove_from_layer replaced the tuple
            self._hooks, self._hooks_for = {}, self.layer
        hooks = self._hooks.get(event)
        if hooks is None:
            base = _BASE_HOOKS.get(event)
            hooks = self._hooks[event] = [
                hook for hook in (getattr(cb, event) for cb in self.layer)
                if base is None or getattr(hook, "__func__", None) is not base]
        return hooks

    def call_event(self, event, args, state, control, **kwargs):
        control = super().call_event(event, args, state, control, **kwargs)
        for hook in self._hooks_of(event):  # as transformers' handler calls each of its callbacks
            result = hook(
                args, state, control, model=self.model, processing_class=self.processing_class,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader, eval_dataloader=self.eval_dataloader, **kwargs)
            if result is not None:
                control = result
        if event == "on_train_begin":  # the callbacks of this run (model_init or add_callback may differ)
            self._agreeing = must_agree([*self.callbacks, *self.layer], self._agreement_ctx)
        elif event == "on_train_end":
            self._agreeing = False
        elif self._agreeing and event in AGREED_EVENTS:
            sync_control(control, self._agreement_ctx)
        return control


def agree_on_flags(trainer, ctx) -> None:
    """``trainer.callback_handler`` agrees its flags across the ranks of ``ctx`` from now on (its class
    becomes a subclass with ``AgreeingHandler`` mixed in, once), and takes what raytrainer's handler takes
    from a callback (``callbacks.CallbackHandler``: a mapping of flags returned; any other value than a
    ``TrainerControl`` or None is refused, naming the callback), as raytrainer's own Trainer does."""
    from raytrainer.callbacks import CallbackHandler

    handler = trainer.callback_handler
    if not isinstance(handler, AgreeingHandler):
        cls = type(handler)
        bases = (AgreeingHandler, cls) if issubclass(cls, CallbackHandler) else (
            AgreeingHandler, CallbackHandler, cls)
        handler.__class__ = type(f"Agreeing{cls.__name__}", bases, {})
    handler._agreement_ctx = ctx


def add_to_layer(trainer, callback) -> None:
    """``callback`` among raytrainer's own callbacks of ``trainer`` (after ``agree_on_flags``), in place of
    one of its class there."""
    handler = trainer.callback_handler
    handler.layer = (*[cb for cb in handler.layer if type(cb) is not type(callback)], callback)


def remove_from_layer(trainer, cls: type) -> None:
    handler = trainer.callback_handler
    handler.layer = tuple(cb for cb in handler.layer if not isinstance(cb, cls))


def layer_callback(trainer, cls: type):
    """raytrainer's own callback of class ``cls`` of ``trainer``, or None."""
    return next((cb for cb in getattr(trainer.callback_handler, "layer", ()) if isinstance(cb, cls)), None)
