"""hvd.elastic for TensorFlow and Keras in one process: the states' commit, restore and durable
form, and the Keras callbacks that keep ``state.batch``/``state.epoch`` and commit during fit."""

from __future__ import annotations

import atexit
import pickle

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from support import single_process_job  # noqa: E402

import hpc_horovod.tensorflow as hvd  # noqa: E402
import hpc_horovod.tensorflow.keras as hvd_keras  # noqa: E402
from hpc_horovod.common import elastic as common_elastic  # noqa: E402


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _data(n=12):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def test_tensorflow_state_restores_its_variables_and_objects(single):
    v = tf.Variable([1.0, 2.0])
    state = hvd.elastic.TensorFlowState([v], epoch=1)
    v.assign([5.0, 6.0])
    state.epoch = 2
    state.commit()
    v.assign([0.0, 0.0])
    state.epoch = 3
    state.restore()
    assert v.numpy().tolist() == [5.0, 6.0] and state.epoch == 2
    with pytest.raises(ValueError, match="needs the variables"):
        hvd.elastic.TensorFlowState()


def test_keras_state_restores_model_and_optimizer_and_goes_to_disk(single, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC_DIR", str(tmp_path))
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # builds the optimizer's slots
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=0)
    weights = [w.copy() for w in model.get_weights()]
    slots = [np.array(v.numpy()) for v in model.optimizer.variables]
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not np.allclose(model.get_weights()[0], weights[0])
    state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))
    assert all(np.array_equal(v.numpy(), s) for v, s in zip(model.optimizer.variables, slots))
    state.commit()
    saved = pickle.loads((tmp_path / common_elastic.COMMIT_FILE).read_bytes())
    assert np.array_equal(saved["variables"][0], weights[0])
    assert saved["objects"] == {"batch": 0, "epoch": 0}


def test_keras_state_needs_a_built_model(single):
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built first"):
        hvd_keras.elastic.KerasState(model)


def test_callbacks_commit_and_track_batch_and_epoch_during_fit(single):
    model = _model()
    x, y = _data(12)
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=0)
    commits = []
    original = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), original())
    batches = []
    probe = keras.callbacks.LambdaCallback(
        on_batch_end=lambda b, logs: batches.append((state.epoch, state.batch)))

    @hvd_keras.elastic.run
    def train(state):
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[
            hvd_keras.elastic.UpdateBatchStateCallback(state),
            hvd_keras.elastic.UpdateEpochStateCallback(state),
            hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2),
            probe])

    train(state)
    assert batches == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # every second batch counted across epochs, and at each epoch's end (after the epoch and
    # batch were updated)
    assert commits == [(0, 1), (1, 0), (1, 0), (1, 2), (2, 0)]
    assert (state.epoch, state.batch) == (2, 0)
    with pytest.raises(ValueError, match="at least 1"):
        hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_the_epoch_callback_counts_across_resets(single):
    model = _model()
    x, y = _data(8)
    state = hvd_keras.elastic.KerasState(model, batch=0, epoch=3)  # as after a restart
    model.fit(x, y, batch_size=4, epochs=2, verbose=0,
              callbacks=[hvd_keras.elastic.UpdateEpochStateCallback(state)])
    assert state.epoch == 5


def test_keras_alias_and_tensorflow_module_expose_elastic():
    import hpc_horovod.keras as alias

    assert alias.elastic is hvd_keras.elastic and hvd.elastic.run is hvd_keras.elastic.run
    assert not atexit.unregister(common_elastic.write_record)
