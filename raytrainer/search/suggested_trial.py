"""The Optuna trial as ``model_init(trial)`` gets it on a trial's workers (imported only with Optuna)."""

from __future__ import annotations

from optuna.trial import FixedTrial


class SuggestedTrial(FixedTrial):
    """A ``FixedTrial`` of the parameters ``hp_space`` suggested: ``params``, ``number`` and ``suggest_*`` of
    those names answer as the live trial's do. The live trial holds its study's storage and stays with the
    search; asking this one for a parameter ``hp_space`` did not suggest is an error that says so."""

    @property
    def params(self) -> dict:
        return dict(self._params)  # a FixedTrial's are only those suggested again; the live trial's are all

    def _suggest(self, name, distribution):
        if name not in self._params:
            raise ValueError(
                f"model_init asked the trial for {name!r}, which hp_space did not suggest. raytrainer "
                f"builds the trial's model on its workers; they get the trial's parameters "
                f"({sorted(self._params)}), not the live Optuna trial. Suggest {name!r} in hp_space.")
        return super()._suggest(name, distribution)
