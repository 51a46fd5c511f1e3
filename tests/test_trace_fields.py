"""Events carry their structure in fields (phase, micro-batch, chunk, unit, step, ring step, scopes),
set where they are made; figures, checkers and runs read the fields and never parse a label.

The runs check the fields on what each strategy really sent (one 2-rank launch for all of them), and
check them against the label the same call wrote for people: the label is built from the fields here,
never taken apart. The last tests read the source of ``minitp.viz``, ``minitp.exercises`` and
``minitp.runs`` and refuse a label taken apart to find structure.
"""

import ast
import pickle
from pathlib import Path

import pytest

from minitp import trace
from minitp.launcher import launch

SRC = Path(__file__).resolve().parents[1] / "src" / "minitp"
N = 2


# -- tagged, scope and the fields, on one process (nothing launched) ---------------------------------------
def test_tagged_stamps_every_event_recorded_inside_and_the_inner_block_wins():
    with trace.recording() as tr:
        with trace.scope("answer", "step0"), trace.tagged(step=0, phase="forward"):
            with trace.span("forward", "layers.0") as outer:
                with trace.tagged(phase="backward", unit="layers.1"):
                    with trace.span("backward") as inner:
                        pass
            tr.add(trace.Event(0, "compute", "made by hand", tr.label("x"), 0.0, 1.0))
            tr.add(trace.Event(0, "compute", "says its own", tr.label("y"), 0.0, 1.0, phase="weight"))
        with trace.span("after") as after:
            pass
    assert (outer.step, outer.phase, outer.unit, outer.scopes) == (0, "forward", "", ("answer", "step0"))
    assert (inner.step, inner.phase, inner.unit) == (0, "backward", "layers.1")
    assert inner.label == "answer/step0" and outer.label == "answer/step0/layers.0"  # labels as before
    by_hand, own = tr.events[-3], tr.events[-2]
    assert (by_hand.label, by_hand.phase, by_hand.step, by_hand.scopes) == ("answer/step0/x", "forward", 0,
                                                                            ("answer", "step0"))
    assert own.phase == "weight"  # a field the event sets itself is kept
    assert (after.step, after.phase, after.scopes) == (None, "", ())  # nothing leaks out of the blocks
    assert outer.within("answer") and outer.within("answer", "step0") and not outer.within("step0")


def test_tagged_refuses_a_field_it_does_not_know_and_does_nothing_when_nothing_records():
    with pytest.raises(TypeError, match="layer"):
        with trace.tagged(layer=1):
            pass
    with trace.tagged(phase="forward"), trace.scope("a", "b"):  # no trace recording: no effect, no error
        assert trace.current() is None


def test_events_with_fields_pickle_and_merge():
    with trace.recording(rank=1) as tr:
        with trace.scope("pp"), trace.tagged(phase="backward", microbatch=3, chunk=1, ring_step=2, step=5,
                                             unit="root"):
            with trace.span("backward"):
                pass
    back = pickle.loads(pickle.dumps(tr))
    assert back.events == tr.events
    merged = trace.merge([back])[0]
    fields = ("phase", "microbatch", "chunk", "unit", "step", "ring_step", "scopes")
    assert tuple(getattr(merged, f) for f in fields) == ("backward", 3, 1, "root", 5, 2, ("pp",))
    assert merged.start == 0.0


def test_sent_bytes_by_scope():
    events = [trace.Event(0, "comm", "all_reduce", "answer/x", 0.0, 0.0, sent_bytes=6.0, scopes=("answer",)),
              trace.Event(0, "comm", "all_reduce", "answers", 0.0, 0.0, sent_bytes=1.0),
              trace.Event(0, "comm", "all_reduce", "library/answer", 0.0, 0.0, sent_bytes=2.0,
                          scopes=("library", "answer"))]
    tr = trace.Trace(0, events)
    assert tr.sent_bytes(scope="answer") == 8.0  # inside a scope named "answer", at any depth
    assert tr.sent_bytes("answer") == 7.0  # the label prefix, as a person types it
    assert trace.sent_bytes_per_rank([tr], scope="library") == [2.0]


# -- the fields on what the strategies really sent -----------------------------------------------------------
def _worker():
    import torch
    import torch.distributed as dist

    from minitp import cp, tp
    from minitp.ddp import DistributedDataParallel, split_batch
    from minitp.fsdp import FullyShardedDataParallel
    from minitp.models import TINY, build_model, loss_fn
    from minitp.models.train import TrainConfig, make_optimizer, synthetic_batches
    from minitp.pp import Pipeline

    tokens, targets = synthetic_batches(TINY, TrainConfig(steps=1, batch_size=4))[0]
    with trace.scope("zero"):
        for zero in (3, 2):  # ZeRO-2 gathers after the step
            fsdp = FullyShardedDataParallel(build_model(TINY, seed=0), zero=zero)
            optimizer = fsdp.attach(make_optimizer(fsdp.parameters(), 1e-3))
            loss_fn(fsdp(split_batch(tokens)), split_batch(targets)).backward()
            optimizer.step()
            fsdp.full_state_dict()
    with trace.scope("replicas"):
        ddp = DistributedDataParallel(build_model(TINY, seed=0), bucket_mb=0.05)
        loss_fn(ddp(split_batch(tokens)), split_batch(targets)).backward()
    with trace.scope("pipeline"):
        for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
            Pipeline(build_model(TINY, seed=0), None, schedule, 4, virtual_stages=v).forward_backward(tokens, targets)
    with trace.scope("ring"):
        g = torch.Generator().manual_seed(0)
        q, k, v = (cp.shard_sequence(torch.randn(2, h, 8, 4, generator=g), None, dim=2).requires_grad_()
                   for h in (4, 2, 2))
        cp.ring_attention(q, k, v, None).pow(2).sum().backward()
    with trace.scope("tensor"):
        for sequence_parallel in (False, True):
            model = tp.parallelize(build_model(TINY, seed=0), None, sequence_parallel)
            shard = (lambda t: t.chunk(N, dim=1)[dist.get_rank()]) if sequence_parallel else (lambda t: t)
            x = shard(torch.randn(2, 8, TINY.dim, generator=torch.Generator().manual_seed(1)))
            block = model.layers[0]
            block(x, model.rope_cos[:8], model.rope_sin[:8]).pow(2).sum().backward()
        logits = tp.ColumnParallelLinear(torch.nn.Linear(TINY.dim, 16, bias=False), None)(
            torch.randn(2, 8, TINY.dim, generator=torch.Generator().manual_seed(2), requires_grad=True))
        tp.vocab_parallel_cross_entropy(logits, torch.randint(0, 16, (2, 8)), None).backward()


@pytest.fixture(scope="module")
def run():
    return launch(_worker, N, echo=False, timeout=240)


def _comm(run, scope):
    return [e for t in run.traces for e in t.comm() if e.within(scope)]


def test_every_fsdp_gather_and_reduce_scatter_names_its_unit_and_phase(run):
    events = _comm(run, "zero")
    assert {e.op for e in events} == {"all_gather", "reduce_scatter"}
    for e in events:
        assert e.unit and e.phase, e
        what = "reduce_scatter" if e.op == "reduce_scatter" else f"all_gather.{e.phase}"
        assert e.label == f"zero/fsdp/{e.unit}/{what}", e  # the label people read says the same
    assert {e.phase for e in events} == {"forward", "backward", "step", "state_dict"}
    assert {e.phase for e in events if e.op == "reduce_scatter"} == {"backward"}
    assert {e.unit for e in events} == {"root", "layers.0", "layers.1", "layers.2", "layers.3"}


def test_ddp_buckets_are_backward_and_the_start_up_broadcast_is_init(run):
    events = _comm(run, "replicas")
    assert {(e.op, e.phase) for e in events} == {("broadcast", "init"), ("all_reduce", "backward")}
    assert len([e for e in events if e.op == "all_reduce"]) > N  # several buckets per rank


def test_every_pipeline_send_and_recv_names_its_microbatch_phase_and_chunk(run):
    events = _comm(run, "pipeline")
    assert {e.op for e in events} == {"send", "recv"}
    for e in events:
        assert e.microbatch in range(4) and e.phase in ("forward", "backward") and e.chunk in (0, 1), e
        sender_stage = e.rank if e.op == "send" else e.peer
        assert e.label.startswith(f"pipeline/pp/{e.phase}/mb{e.microbatch}"), e
        if e.label.count("/") == 4:  # interleaved: the sender's piece, chunk·p + its stage
            assert e.label.endswith(f"/piece{e.chunk * N + sender_stage}"), e
    assert {e.chunk for e in events} == {0, 1}
    computes = [e for t in run.traces for e in t.events if e.kind == "compute" and e.within("pipeline")]
    assert {e.phase for e in computes} == {"forward", "backward", "weight"}  # zero-bubble's W too
    assert all(e.phase == e.op and e.microbatch in range(4) and e.chunk in (0, 1) for e in computes)


def test_every_ring_message_and_compute_names_its_ring_step(run):
    events = _comm(run, "ring")
    assert {e.op for e in events} == {"send", "recv"}
    for e in events:
        assert e.ring_step in range(N) and e.phase in ("forward", "backward"), e
        assert e.label in (f"ring/cp/{e.phase}/step{e.ring_step}", f"ring/cp/backward/grad{e.ring_step}"), e
    computes = [e for t in run.traces for e in t.events if e.kind == "compute" and e.within("ring")]
    assert sorted((e.phase, e.ring_step) for e in computes if e.rank == 0) == [
        ("backward", 0), ("backward", 1), ("forward", 0), ("forward", 1)]


def test_every_tensor_parallel_message_names_its_phase(run):
    events = _comm(run, "tensor")
    assert {e.phase for e in events} == {"forward", "backward"}
    ops = {e.label.rsplit("/", 1)[-1] for e in events}  # (the test may read labels: it checks them)
    assert {"f.backward", "g.forward", "sequence_gather.forward", "sequence_gather.backward",
            "sequence_scatter.forward", "sequence_scatter.backward"} <= ops
    for e in events:
        if e.label.endswith((".forward", ".backward")):
            assert e.label.endswith(f".{e.phase}"), e


# -- nobody takes a label apart ------------------------------------------------------------------------------
_TAKING_APART = {"split", "rsplit", "partition", "rpartition", "removeprefix", "removesuffix", "startswith",
                 "endswith"}


def label_parses(source: str) -> list[str]:
    """Where ``source`` takes a label apart to find structure: a string method that splits or tests
    text (``_TAKING_APART``) called on an expression that mentions ``label``, a ``re.`` call with an
    argument that mentions it, or an ``in`` / ``not in`` test inside an expression that mentions it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if node.func.attr in _TAKING_APART and "label" in ast.unparse(target):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif isinstance(target, ast.Name) and target.id == "re" and any(
                    "label" in ast.unparse(a) for a in [*node.args, *(k.value for k in node.keywords)]):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            containers = [c for op, c in zip(node.ops, node.comparators) if isinstance(op, (ast.In, ast.NotIn))]
            if any("label" in ast.unparse(c) for c in containers):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_catches_each_way_of_taking_a_label_apart():
    parses = ["e.label.split('/')[0]", "label.rsplit('/', 1)", "e.label.partition('/')", "e.label.rpartition('/')",
              "e.label.removeprefix('answer')", "label.removesuffix('.forward')", "e.label.startswith(prefix)",
              "e.label.endswith('.step')", "re.match('step(\\\\d+)', e.label)", "re.search(pattern, string=e.label)",
              "'state_dict' not in e.label", "'/fsdp/' in '/' + e.label", "(e.label + '/').split('/')"]
    for source in parses:
        assert label_parses(source), source
    fine = ["e.labelled(prefix)", "ax.set_xlabel('time')", "e.phase.startswith('back')", "'answer' in e.scopes",
            "name.split('.')", "text.rpartition('/')", "label = piece.replace('layers.', 'block ')",
            "e.label == 'x'", "f'{e.label}'", "re.compile('x')"]
    for source in fine:
        assert not label_parses(source), source


@pytest.mark.parametrize("package", ["viz", "exercises", "runs"])
def test_no_figure_checker_or_run_takes_a_label_apart(package):
    found = {}
    for path in sorted((SRC / package).rglob("*.py")):
        parses = label_parses(path.read_text())
        if parses:
            found[str(path.relative_to(SRC))] = parses
    assert not found, f"labels are text for people; read Event's fields instead: {found}"
