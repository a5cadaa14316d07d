"""bex.torch against a real cluster (conftest.py): rows in forward, gradients summed per key
in backward, applied once by the table's optimizer on the servers."""

import numpy as np
import pytest
import torch

import bex
import bex.torch

# The session cluster's "sgd" table: dim 4, w -= 0.5 * g on the servers.
LR = np.float32(0.5)


@pytest.fixture(params=["rdma", "tcp"])
def client(cluster, request):
    return bex.Client(cluster, transport=request.param)


def fresh_keys(client, n, base):
    """Keys no other test touches (per transport and test)."""
    return np.arange(n, dtype=np.uint64) + np.uint64(base + (1 << 40 if client.transport == "tcp" else 0))


def test_keys_of_reads_int64_as_uint64_without_converting():
    t = torch.tensor([[1, -1], [2, 3]])
    k = bex.torch.keys_of(t)
    assert k.dtype == np.uint64 and k.tolist() == [1, 2**64 - 1, 2, 3]
    assert bex.torch.keys_of(np.array([7], dtype=np.int32)).tolist() == [7]
    with pytest.raises(TypeError):
        bex.torch.keys_of(torch.tensor([1.5]))


def test_embedding_forward_is_the_fetched_rows(client):
    emb = bex.torch.Embedding(client, "emb")
    ids = torch.tensor([[3, 9, 3], [9, 1, 2]])
    out = emb(ids)
    assert out.shape == (2, 3, 8) and out.dtype == torch.float32
    want = client.fetch("emb", ids.reshape(-1).numpy().astype(np.uint64)).reshape(2, 3, 8)
    np.testing.assert_array_equal(out.detach().numpy(), want)
    assert list(emb.parameters()) == [], "the table lives on the PS, not in the module"


def test_backward_pushes_each_keys_gradient_summed_once(client):
    keys = fresh_keys(client, 3, 1000)
    emb = bex.torch.Embedding(client, "sgd")
    before = client.fetch("sgd", keys)
    # Key 0 used three times, key 1 once, key 2 twice, with different weights per use.
    ids = torch.from_numpy(keys[[0, 1, 0, 2, 0, 2]].astype(np.int64))
    weights = torch.arange(1, 7, dtype=torch.float32).reshape(6, 1)
    (emb(ids) * weights).sum().backward()
    summed = np.zeros((3, 4), np.float32)
    for use, k in enumerate([0, 1, 0, 2, 0, 2]):
        summed[k] += np.float32(use + 1)
    np.testing.assert_array_equal(client.fetch("sgd", keys), before - LR * summed)


def test_eval_and_no_grad_never_push(client):
    keys = fresh_keys(client, 2, 2000)
    emb = bex.torch.Embedding(client, "sgd")
    before = client.fetch("sgd", keys)
    with torch.no_grad():
        assert emb(keys).grad_fn is None
    emb.eval()
    out = emb(keys)
    assert out.grad_fn is None and not out.requires_grad
    # A loss through an eval-mode lookup still runs backward (w needs a grad), and pushes
    # nothing to the table.
    w = torch.ones(1, requires_grad=True)
    (emb(keys) * w).sum().backward()
    assert w.grad is not None
    np.testing.assert_array_equal(client.fetch("sgd", keys), before)
    # The same in train mode pushes: the check above can fail.
    emb.train()
    (emb(keys) * w).sum().backward()
    assert not np.array_equal(client.fetch("sgd", keys), before)


def test_inputs_on_another_device_are_refused(client):
    emb = bex.torch.Embedding(client, "emb")
    with pytest.raises(ValueError, match="CPU tensors"):
        emb(torch.zeros(3, dtype=torch.int64, device="meta"))
    bag = bex.torch.EmbeddingBag(client, "emb")
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64, device="meta"))


def test_max_pooling_sends_each_element_to_its_maximum(client):
    keys = fresh_keys(client, 2, 2500)
    before = client.fetch("sgd", keys)
    bag = bex.torch.EmbeddingBag(client, "sgd", mode="max")
    # One bag of both keys: each output element's gradient goes to the key holding its max.
    bag(torch.from_numpy(keys.astype(np.int64)).reshape(1, 2)).sum().backward()
    wins = before[0] >= before[1]
    want = before - LR * np.stack([wins, ~wins]).astype(np.float32)
    np.testing.assert_array_equal(client.fetch("sgd", keys), want)


class RecordingClient:
    def __init__(self):
        self.pushes = []

    def push(self, table, keys, grads):
        self.pushes.append((table, keys.tolist(), grads.copy()))


def test_rows_with_an_all_zero_gradient_are_not_pushed():
    """Adam and FTRL move a row for a zero gradient (momentum, step count), so a row without
    a gradient must not be sent (max pooling, DenseParameters' unused rows)."""
    c = RecordingClient()
    keys = np.array([7, 8, 9], dtype=np.uint64)
    g = np.array([[0, 0], [0, 1e-30], [0, 0]], dtype=np.float32)
    bex.torch._push_nonzero(c, "t", keys, g)
    assert [(t, k) for t, k, _ in c.pushes] == [("t", [8])]
    np.testing.assert_array_equal(c.pushes[0][2], g[1:2])
    bex.torch._push_nonzero(c, "t", keys, np.zeros((3, 2), np.float32))
    assert len(c.pushes) == 1, "nothing to send: no push at all"
    bex.torch._push_nonzero(c, "t", keys, np.ones((3, 2), np.float32))
    assert c.pushes[1][1] == [7, 8, 9]


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_pools_like_torch(client, mode):
    keys = fresh_keys(client, 5, 3000 + 100 * ["sum", "mean", "max"].index(mode))
    rows = torch.from_numpy(client.fetch("sgd", keys))
    bag = bex.torch.EmbeddingBag(client, "sgd", mode=mode)
    # 1-D ids with offsets: bags [0, 1, 0], [3], [4, 4, 2, 1].
    pick = [0, 1, 0, 3, 4, 4, 2, 1]
    ids = torch.from_numpy(keys[pick].astype(np.int64))
    offsets = torch.tensor([0, 3, 4])
    out = bag(ids, offsets)
    want = torch.nn.functional.embedding_bag(torch.tensor(pick), rows, offsets, mode=mode)
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    # 2-D ids: one bag per row.
    two = bag(torch.from_numpy(keys[[[0, 1], [2, 3]]].astype(np.int64)))
    want2 = torch.nn.functional.embedding_bag(torch.tensor([[0, 1], [2, 3]]), rows, mode=mode)
    torch.testing.assert_close(two.detach(), want2, rtol=0, atol=0)


def test_embedding_bag_backward_matches_torchs_gradient(client):
    keys = fresh_keys(client, 4, 4000)
    before = client.fetch("sgd", keys)
    local = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(before.copy()), freeze=False,
                                                  mode="sum")
    bag = bex.torch.EmbeddingBag(client, "sgd", mode="sum")
    pick = torch.tensor([0, 1, 1, 3, 0, 0])
    offsets = torch.tensor([0, 2, 4])
    psw = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0])
    target = torch.tensor([[1.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 0, 4.0]])
    ((bag(torch.from_numpy(keys.astype(np.int64))[pick], offsets, psw) - target) ** 2).sum().backward()
    ((local(pick, offsets, per_sample_weights=psw) - target) ** 2).sum().backward()
    grad = local.weight.grad.numpy()
    # Key 2 is not in the batch: its row is untouched.
    np.testing.assert_allclose(client.fetch("sgd", keys), before - LR * grad, rtol=0, atol=1e-6)


class FakeJagged:
    """The part of torchrec's JaggedTensor bex.torch reads."""

    def __init__(self, values, lengths, weights=None):
        self._v, self._l, self._w = values, lengths, weights

    def values(self):
        return self._v

    def lengths(self):
        return self._l

    def weights_or_none(self):
        return self._w


class FakeKJT:
    """torchrec.KeyedJaggedTensor's to_dict(), for machines without TorchRec."""

    def __init__(self, d):
        self.d = d

    def to_dict(self):
        return self.d


def kjts():
    """KeyedJaggedTensor factories: TorchRec's own where it imports, and the stand-in."""
    out = [("stand-in", lambda d: FakeKJT({k: FakeJagged(v, l) for k, (v, l) in d.items()}))]
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except Exception:  # not installed, or its native library does not load on this machine
        return out

    def real(d):
        keys = list(d)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.cat([d[k][0] for k in keys]),
            lengths=torch.cat([d[k][1] for k in keys]),
        )

    return out + [("torchrec", real)]


@pytest.mark.parametrize("make", [m for _, m in kjts()], ids=[n for n, _ in kjts()])
def test_collection_pools_each_feature_from_one_fetch_per_table(client, make):
    keys = fresh_keys(client, 6, 5000).astype(np.int64)
    ebc = bex.torch.EmbeddingBagCollection(client, {"user": "sgd", "item": "sgd", "ctx": "emb"})
    # Batch of 3: user ids per sample [0], [1, 2], []; item [3], [3], [4, 5]; ctx [0], [0], [1].
    feats = {
        "user": (torch.tensor(keys[[0, 1, 2]]), torch.tensor([1, 2, 0])),
        "item": (torch.tensor(keys[[3, 3, 4, 5]]), torch.tensor([1, 1, 2])),
        "ctx": (torch.tensor(keys[[0, 0, 1]]), torch.tensor([1, 1, 1])),
    }
    out = ebc(make(feats))
    assert list(out) == ["user", "item", "ctx"]
    sgd = client.fetch("sgd", keys.astype(np.uint64))
    emb = client.fetch("emb", keys.astype(np.uint64))
    np.testing.assert_array_equal(out["user"].detach().numpy(),
                                  np.stack([sgd[0], sgd[1] + sgd[2], np.zeros(4, np.float32)]))
    np.testing.assert_array_equal(out["item"].detach().numpy(),
                                  np.stack([sgd[3], sgd[3], sgd[4] + sgd[5]]))
    np.testing.assert_array_equal(out["ctx"].detach().numpy(), np.stack([emb[0], emb[0], emb[1]]))
    # Plain dicts of (values, lengths) work the same.
    torch.testing.assert_close(ebc(feats)["item"], out["item"], rtol=0, atol=0)
    # Backward: "user" and "item" share the sgd table, so key 3 (item twice) and keys 0-2
    # (user) arrive in one push, each key's gradient summed over both features' uses.
    before = client.fetch("sgd", keys.astype(np.uint64))
    (out["user"].sum() + 2 * out["item"].sum()).backward()
    uses = np.array([1, 1, 1, 2 * 2, 2, 2], dtype=np.float32)  # user 0,1,2; item 3 (x2), 4, 5
    np.testing.assert_array_equal(client.fetch("sgd", keys.astype(np.uint64)),
                                  before - LR * uses[:, None] * np.ones((6, 4), np.float32))
    with pytest.raises(KeyError):
        ebc({"user": feats["user"]})


def test_dense_parameters_live_on_the_ps(client):
    # dim 4 rows of the "sgd" table: 2x3 + 3 = 9 parameters in 3 rows, the last padded.
    layer = torch.nn.Linear(3, 3)
    layer.weight.data = layer.weight.data[:2].clone()
    layer.bias.data = layer.bias.data[:3].clone()
    model_id = 11 if client.transport == "rdma" else 12
    dense = bex.torch.DenseParameters(client, layer, table="sgd", model_id=model_id)
    assert dense.numel == 9 and len(dense.keys) == 3
    np.testing.assert_array_equal(dense.keys, bex.dense_keys(model_id, 9, 4))
    rows = client.fetch("sgd", dense.keys).reshape(-1)
    dense.pull()
    np.testing.assert_array_equal(layer.weight.detach().numpy().reshape(-1), rows[:6])
    np.testing.assert_array_equal(layer.bias.detach().numpy(), rows[6:9])
    layer.weight.grad = torch.ones_like(layer.weight)
    layer.bias.grad = None  # counts as zero
    dense.push()
    dense.pull()
    np.testing.assert_array_equal(layer.weight.detach().numpy().reshape(-1), rows[:6] - LR)
    np.testing.assert_array_equal(layer.bias.detach().numpy(), rows[6:9])


def test_unknown_tables_are_named(client):
    with pytest.raises(KeyError, match="emb"):
        bex.torch.Embedding(client, "nope")
    with pytest.raises(ValueError):
        bex.torch.EmbeddingBag(client, "emb", mode="median")


def test_bags_of_no_ids_pool_to_zeros(client):
    bag = bex.torch.EmbeddingBag(client, "sgd")
    out = bag(torch.zeros((3, 0), dtype=torch.int64))
    assert out.shape == (3, 4) and not out.detach().any()


def test_an_empty_batch_fetches_and_pushes_nothing(client):
    emb = bex.torch.Embedding(client, "sgd")
    out = emb(torch.zeros((0, 3), dtype=torch.int64))
    assert out.shape == (0, 3, 4)
    out.sum().backward()
    bag = bex.torch.EmbeddingBag(client, "sgd")
    pooled = bag(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0]))
    assert pooled.shape == (2, 4) and not pooled.detach().any()
