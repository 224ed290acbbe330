"""Tier 1: fine-tuning's early stopping (train/task_loop.py EarlyStopping): improvement, patience, the loss
tie-break on a plateau of the metric, and its state through a checkpoint."""

from megagenome.train.task_loop import EarlyStopping


def test_a_plateau_of_the_metric_with_a_falling_loss_keeps_improving():
    """MCC on 80 validation windows stays at 0.925 from step 200 while the loss falls (what the two-species task
    showed): each such evaluation is the new best, so patience does not run out and the later checkpoint is kept."""
    s = EarlyStopping("mcc", True, patience=2)
    assert s.update(100, 0.85, 0.30) and s.update(200, 0.925, 0.145)
    assert s.update(300, 0.925, 0.122) and s.best_step == 300 and s.best_loss == 0.122
    assert not s.update(400, 0.925, 0.1224) and s.bad_evals == 1  # level, and the loss no lower
    assert not s.update(450, 0.925, 0.12199) and s.bad_evals == 2  # lower by float noise (< LOSS_TIE_MARGIN)
    s.bad_evals = 1
    assert not s.update(500, 0.90, 0.05) and s.exhausted  # a worse metric never wins on loss
    assert s.best_step == 300 and s.best == 0.925


def test_lower_is_better_and_undefined_values():
    s = EarlyStopping("loss", False, patience=0)
    assert s.update(1, 0.5) and not s.update(2, None) and s.update(3, 0.4) and not s.exhausted
    assert not s.update(4, 0.4)  # a tie with no loss to break it is not an improvement


def test_state_round_trips_and_old_states_restore():
    s = EarlyStopping("mcc", True, patience=3)
    s.update(10, 0.5, 0.7)
    assert EarlyStopping.restore(s.state()) == s
    old = {"metric": "mcc", "higher_is_better": True, "patience": 3, "best": 0.5, "best_step": 10, "bad_evals": 1}
    restored = EarlyStopping.restore(old)  # a checkpoint written before best_loss existed
    assert restored.best_loss is None and not restored.update(20, 0.5, 0.1) and restored.update(30, 0.6, 0.2)
