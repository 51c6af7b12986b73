"""Document lanes (data.lanes): window k of the run comes from lane k mod L, lane j packing
documents j, j+L, ... into its own stream; layout independence and exact resume with lanes; the
evaluation set dealt over lanes; clear errors for lane settings that cannot work."""

import json

import pytest
import torch

from trillion.errors import ConfigError
from trillion.trainer.checkpoint.resume_check import check_resume_config, settings
from trillion.trainer.config.schema import Data, load_config, to_toml
from trillion.trainer.data.loader import build_data_loader, dealt_windows
from trillion.trainer.data.tokenizer import ByteTokenizer

# unequal lengths, so the lanes run out of documents (and wrap) at different steps
DOCS = [f"<doc {i:02d}> " + "word " * (i % 7 + 1) for i in range(40)]
WINDOW = 17  # seq_len 16 + 1


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def stream_of(docs):
    tok = ByteTokenizer()
    return [t for d in docs for t in tok.encode(d) + [tok.eos_id]]


def loader(path, lanes, *, global_batch=4, micro=2, rank=0, size=1, held_out=0.0):
    return build_data_loader(
        Data(path=str(path), lanes=lanes),
        ByteTokenizer(),
        seed=0,
        seq_len=16,
        global_batch_size=global_batch,
        micro_batch_size=micro,
        held_out=held_out,
        dp_rank=rank,
        dp_size=size,
    )


def global_windows(loaders, batches):
    """`batches` global batches of windows (seq_len + 1 tokens), gathered over the ranks in rank order."""
    out = []
    for _ in range(batches):
        out.append(torch.cat([torch.cat([x, y[:, -1:]], dim=1) for one in loaders for x, y in one.next_batch()]))
    return torch.cat(out)


@pytest.mark.parametrize("lanes", [3, 8])
def test_window_k_comes_from_lane_k_mod_L_which_packs_documents_j_j_plus_L(jsonl, lanes):
    windows = global_windows([loader(jsonl, lanes)], 6)  # 24 windows: lane j gives 24/L of them, within epoch 0
    for j in range(lanes):
        mine = windows[j::lanes].flatten().tolist()
        assert mine == stream_of(DOCS[j::lanes])[: len(mine)], j
    # the first windows of the lanes open documents 0, 1, 2, ...: a batch of 4 draws from min(4, L) documents
    first = [ByteTokenizer().decode(w.tolist())[:8] for w in windows[: min(4, lanes)]]
    assert first == [f"<doc {j:02d}>" for j in range(min(4, lanes))]


@pytest.mark.parametrize("lanes", [3, 8])
def test_global_batches_do_not_depend_on_the_data_parallel_size(jsonl, lanes):
    one = global_windows([loader(jsonl, lanes, global_batch=8)], 12)
    for size in (2, 4):
        ranks = [loader(jsonl, lanes, global_batch=8, rank=r, size=size) for r in range(size)]
        assert torch.equal(global_windows(ranks, 12), one), size


def test_resume_mid_turn_under_another_layout_sees_the_same_batches(jsonl):
    """3 lanes, batches of 4: after 5 batches (20 windows) lane 2 is next and the lanes stand in
    different documents and epochs. The state is a few integers per lane; a run of 2 data-parallel
    ranks loading it continues with exactly the single process's batches, across wrap-arounds."""
    straight = global_windows([loader(jsonl, 3)], 40)
    first = loader(jsonl, 3)
    global_windows([first], 5)
    state = first.state_dict()
    assert state["lanes"] == 3 and state["next_lane"] == 20 % 3
    assert {key: len(state[key]) for key in ("epoch", "doc_index", "offset")} == {
        "epoch": 3,
        "doc_index": 3,
        "offset": 3,
    }
    assert all(isinstance(v, int) for key in ("epoch", "doc_index", "offset") for v in state[key])
    assert all(index % 3 == j for j, index in enumerate(state["doc_index"]))  # lane j stands in a document j + nL
    ranks = [loader(jsonl, 3, rank=r, size=2) for r in range(2)]
    for one in ranks:
        one.load_state_dict(json.loads(json.dumps(state)))  # plain integers: survives any serialization
    assert torch.equal(global_windows(ranks, 35), straight[20:])
    assert min(ranks[0].state_dict()["epoch"]) >= 1  # every lane wrapped around on the way


def test_one_lane_keeps_the_state_checkpoints_had_before_lanes(jsonl):
    """data.lanes=1 saves and loads (epoch, doc_index, offset) as before, so such a checkpoint
    resumes; a state with another lane count is refused naming data.lanes."""
    single = loader(jsonl, 1)
    global_windows([single], 3)
    old = single.state_dict()
    assert set(old) == {"epoch", "doc_index", "offset"} and old["offset"] > 0
    resumed = loader(jsonl, 1)
    resumed.load_state_dict(dict(old))
    assert torch.equal(global_windows([resumed], 2), global_windows([single], 2))
    eight = loader(jsonl, 8)
    global_windows([eight], 1)
    with pytest.raises(ConfigError, match=r"in 8 lanes but this run reads at most 3 \(data.lanes\).*--data.lanes=8"):
        loader(jsonl, 3).load_state_dict(eight.state_dict())


def test_a_corpus_that_changed_size_under_an_accepted_resume_keeps_the_saved_lanes(tmp_path, jsonl):
    """Lanes are at most one per document, so a corpus of 3 documents read with data.lanes=8 runs in
    3; resumed (checkpoint.accept_data_change) after a fourth was added, it continues in the 3 lanes
    its position counts in, each lane where it stood."""
    path = tmp_path / "grows.jsonl"
    texts = ["first " * 5, "second " * 5, "third " * 5]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    small = loader(path, 8)
    global_windows([small], 2)
    state = small.state_dict()
    assert state["lanes"] == 3
    with open(path, "a") as more:
        more.write(json.dumps({"text": "fourth " * 5}) + "\n")
    grown = loader(path, 8)
    assert len(grown.windows.lanes) == 4
    grown.load_state_dict(state)
    assert len(grown.windows.lanes) == 3 and grown.state_dict() == state
    # lane 0 had read 3 windows (51 tokens) of its 31-token document: the next one ends that document's
    # second epoch and goes on into document 3, the new one, which lane 0 of 3 owns; it is the second
    # window of the next batch (8 windows so far: lane 2 is next)
    assert (state["epoch"][0], state["doc_index"][0], state["offset"][0]) == (1, 0, 51 - 31)
    expected = (stream_of(texts[:1])[20:] + stream_of(["fourth " * 5]))[:WINDOW]
    assert global_windows([grown], 1)[1].tolist() == expected


def test_a_checkpoint_from_before_lanes_resumes_only_with_one_lane(tmp_path):
    """Its config.toml has no data.lanes: it read one document after another, so the default (8) is
    refused with the flag that continues it, and --data.lanes=1 resumes."""
    saved = {"data.path": "", "data.prepared": "", "eval.held_out": 0.01}
    with pytest.raises(ConfigError, match=r"data.lanes was 1 there and is 8 now .*--data.lanes=1"):
        check_resume_config(saved, settings(to_toml(load_config())), tmp_path)
    check_resume_config(saved, settings(to_toml(load_config(None, ["--data.lanes=1"]))), tmp_path)
    check_resume_config({**saved, "data.lanes": 8}, settings(to_toml(load_config())), tmp_path)


def test_held_out_documents_never_reach_a_lane(jsonl):
    """Each lane's stream is exactly its kept documents in order: a held-out one drops out where it falls."""
    from trillion.trainer.data.loader import is_held_out

    fraction, lanes = 0.3, 3
    held = [d for d in DOCS if is_held_out(d, fraction)]
    assert 5 < len(held) < 30
    ranks = [loader(jsonl, lanes, held_out=fraction, rank=r, size=2) for r in range(2)]
    windows = global_windows(ranks, 9)  # 36 windows: 12 per lane, inside every lane's first epoch
    for j in range(lanes):
        kept = [d for d in DOCS[j::lanes] if not is_held_out(d, fraction)]
        mine = windows[j::lanes].flatten().tolist()
        assert mine == stream_of(kept)[: len(mine)], j
    text = ByteTokenizer().decode(windows.flatten().tolist())
    assert not [d for d in held if d.split(">")[0] + ">" in text]


def test_bad_lane_settings_are_clear_errors(tmp_path, jsonl):
    for value in ("0", "-2"):
        with pytest.raises(ConfigError, match=f"data.lanes={value} is out of range: it must be at least 1"):
            load_config(None, [f"--data.lanes={value}"])
    # a lane whose every document is empty (or held out) has nothing to read
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("some text", "", "more text")))
    empty_lane = build_data_loader(
        Data(path=str(path), lanes=2),
        ByteTokenizer(),
        seed=0,
        seq_len=4,
        global_batch_size=2,
        micro_batch_size=2,
        held_out=0.0,
    )
    with pytest.raises(
        ConfigError, match=r"data.lanes=2: lane 1 \(documents 1, 3, \.\.\. .*holds no text.*Lower --data.lanes"
    ):
        empty_lane.next_batch()


def test_fewer_documents_than_lanes_read_one_lane_each(tmp_path):
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("alpha " * 9, "beta " * 9)))
    few = build_data_loader(
        Data(path=str(path), lanes=8),
        ByteTokenizer(),
        seed=0,
        seq_len=7,
        global_batch_size=4,
        micro_batch_size=4,
        held_out=0.0,
    )
    assert len(few.windows.lanes) == 2
    ((x, y),) = few.next_batch()
    windows = torch.cat([x, y[:, -1:]], dim=1)
    alpha, beta = stream_of(["alpha " * 9]), stream_of(["beta " * 9])
    assert windows.tolist() == [alpha[:8], beta[:8], alpha[8:16], beta[8:16]]


def test_dealt_windows_span_the_documents_and_never_repeat_one():
    """Document m to lane m mod L; windows from the lanes in turn; a used-up lane leaves the turn."""
    docs = [[d * 100 + t for t in range(n)] for d, n in enumerate([9, 3, 20, 8])]
    windows = dealt_windows(iter(docs), 2, 4, 100).tolist()
    lane0, lane1 = docs[0] + docs[2], docs[1] + docs[3]  # 29 and 11 tokens: 7 and 2 whole windows

    def cut(tokens):
        return [tokens[i : i + 4] for i in range(0, len(tokens) - 3, 4)]

    assert windows == [cut(lane0)[0], cut(lane1)[0], cut(lane0)[1], cut(lane1)[1], *cut(lane0)[2:]]
    assert dealt_windows(iter(docs), 2, 4, 3).tolist() == windows[:3]
    joined = [t for doc in docs for t in doc]
    assert dealt_windows(iter(docs), 1, 4, 100).flatten().tolist() == joined[: len(joined) // 4 * 4]
    assert dealt_windows(iter([]), 8, 4, 10).shape == (0, 4)


def test_one_batch_of_the_debug_run_draws_from_eight_documents():
    default = build_data_loader(
        Data(), ByteTokenizer(), seed=0, seq_len=256, global_batch_size=8, micro_batch_size=8, held_out=0.01
    )
    default.next_batch()
    assert Data().lanes == 8 and default.state_dict()["doc_index"] == list(range(8))
