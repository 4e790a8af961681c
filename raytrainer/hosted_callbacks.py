"""The driver's ``callback_handler`` of a trainer on Ray workers (raytrainer/hosted.py).

transformers' Trainer holds one handler: ``DefaultFlowCallback``, the ``report_to`` trackers, the script's
callbacks and the progress bar (or printer), in that order; scripts read it
(``trainer.callback_handler.callbacks``) and edit it (``add_callback``, ``pop_callback``,
``remove_callback``). On Ray workers each rank's trainer holds that handler, and the driver holds its
mirror, ``DriverCallbacks``: the same list built the same way, in which the script's callbacks are the
script's own objects, taking on rank 0's state after each call (``absorb_callback_states``), as if they had
run in the script's process. Of them only the display and the callbacks with ``on_driver = True`` run in
the driver (``shown_on_driver``, fed rank 0's events by driver/display.py); the others run on the ranks.

An edit of the list on the driver is an edit on every rank: each one is kept (``Edit``) and made again on
each rank right after it builds the trainer (``apply_edits``). The trackers of the mirror are built but
never called here: they run on rank 0, where transformers runs them.
"""

from __future__ import annotations

import dataclasses

import transformers.trainer_callback as hf

from raytrainer.callbacks import CallbackHandler, explicitly_on_driver


def shown_on_driver(callback) -> bool:
    """Whether ``callback`` of a trainer on workers runs in the driver, fed rank 0's events: the display
    (transformers' progress bar or printer) and any callback with ``on_driver = True``."""
    return isinstance(callback, (hf.ProgressCallback, hf.PrinterCallback)) or explicitly_on_driver(callback)


class DriverCallbacks(CallbackHandler):
    """The driver's mirror of each rank's handler (see the module's docstring). Called directly
    (``trainer.callback_handler.on_push_begin(...)``), it calls every callback it lists, as rank 0's does."""

    @classmethod
    def for_run(cls, args, given, display) -> DriverCallbacks:
        """transformers' list for ``args`` and the constructor's ``callbacks`` (``given``), in transformers'
        order and with its warnings (a class given twice), the driver's ``display`` last."""
        from transformers.trainer import DEFAULT_CALLBACKS

        from raytrainer.integrations import get_reporting_integration_callbacks

        defaults = [*DEFAULT_CALLBACKS, *get_reporting_integration_callbacks(args.report_to)]
        handler = cls([*defaults, *(given or ())], None, None, None, None)
        handler.add_callback(display)
        return handler


@dataclasses.dataclass(frozen=True)
class Edit:
    """One edit of the driver's list, as each rank makes it: ``added`` (a class or an instance), or the
    callback removed, named by its class and its place among that class's instances (``nth``; None for a
    removal by class, which removes the first instance of the class or of a subclass, as transformers
    does)."""

    added: object = None
    removed: type | None = None
    nth: int | None = None

    def apply(self, handler) -> None:
        if self.added is not None:
            handler.add_callback(self.added)
        elif self.nth is None:
            handler.remove_callback(self.removed)
        else:
            same = [cb for cb in handler.callbacks if type(cb) is self.removed]
            if self.nth < len(same):
                handler.callbacks.remove(same[self.nth])


def removal(handler, callback) -> Edit | None:
    """The ``Edit`` that removes ``callback`` (a class, or an instance ``handler`` lists; None if it does
    not) on the ranks."""
    if isinstance(callback, type):
        return Edit(removed=callback)
    same = [cb for cb in handler.callbacks if type(cb) is type(callback)]
    return next((Edit(removed=type(callback), nth=i) for i, cb in enumerate(same) if cb is callback), None)


def for_ranks(edit: Edit) -> bool:
    """Whether the ranks make ``edit``: not an addition of a callback that runs in the driver."""
    return edit.added is None or not explicitly_on_driver(edit.added)


def apply_edits(trainer, edits) -> None:
    """A rank's trainer, just built, with the driver's edits of its list made (in order)."""
    for edit in edits:
        edit.apply(trainer.callback_handler)
