"""Self-distillation: answer the user turns of conversations with the target, through a `Generator`.

Draft heads learn best from the target's own distribution, so the assistant turns of a data set are replaced by
the target's answers, turn by turn (`mtp_train.engine.turns`: answer t is generated after the model's own answers
1..t-1; the prompt, stop tokens and answer text follow that module's special-token rule, the one evaluation uses
too). Generation stops on the model's EOS ids and on the template's end-of-turn token, which is not part of the
stored text.

Output: messages JSONL, one record per (conversation, sample):

    {"id": "<conv id>" (n = 1) or "<conv id>#<k>" (k = 0..n-1), "messages": [...],
     "source": {"file", "line", "id"}, "finish_reasons": ["stop" | "length", ...per turn],
     "gen_tokens": [...per turn, the end-of-turn token included], "provenance": {...}}

Streaming (`stage`): the conversations are read as they are answered, `window` at a time (`engine.turns.
DialogueWindow`), so memory follows the window and not the data; what is kept per conversation is a few numbers
(`ids`: 64-bit hashes of the records done before and of the ids seen, and rank 0's merge order).

Files, resume and ranks (`records`): every rank streams all conversations, answers r, r + world, ... and appends
each record to the part file `<out>.rank<r>` as soon as all its turns are done (flushed per record, fsynced every
few records), in the order they complete. After a barrier, rank 0 merges `<out>` and every part into `<out>` in the
original conversation order, which it learnt while reading (temporary file + rename), and removes the parts. A merge
also runs at start-up, before anything is read or generated, so a killed run (of any world size) is folded in first
(in the order met; the final merge sorts); a torn last line is dropped there with a warning. Records already in
`<out>` are then skipped: only conversations whose record is missing, e.g. multi-turn ones cut short, are answered
again. A resumed run must use the same target, tokenizer, chat template and sampling settings (`provenance`,
checked per record).

Seeds (`sampling`): every request gets its own seed from (seed, conversation id, sample index, turn), so that the
text does not depend on batching, on the window, on the rank split or on what an earlier run already did.

Generator (`mtp_train.engine.generator`): the stage asks it for answers (`Generator.stream`: requests fed from the
window, token ids and finish reasons back as each completes), for its limits (context, KV pages), its counters and
its provenance (recorded as `provenance.target`), and reads nothing else of it; `EngineGenerator` is our engine
behind that interface.

Counters, and why a record was not produced (a prompt too long for `max_prompt_tokens`, the KV pool or the context,
an empty answer, a template error, a repeated id): `stats`. The settings are `mtp_train.config.RegenerateConfig`;
`stage.regenerate` is what `mtp-regenerate` runs. The stage sits on the floor above the engine; `data/` below
supplies the readers and chat rendering.
"""

from mtp_train.data.ids import IdSet
from mtp_train.regenerate.ids import RecordOrder, record_id
from mtp_train.regenerate.provenance import PROVENANCE_VOLATILE, flatten, make_provenance, provenance_differences
from mtp_train.regenerate.records import (
    AFTER_ALL,
    RecordLine,
    RecordWriter,
    RegenerateError,
    consolidate,
    find_parts,
    iter_records,
    part_path,
    plan_order,
    scan_records,
)
from mtp_train.regenerate.sampling import request_params, request_seed
from mtp_train.regenerate.stage import regenerate
from mtp_train.regenerate.stats import RegenerateStats

__all__ = [
    "AFTER_ALL", "PROVENANCE_VOLATILE", "IdSet", "RecordLine", "RecordOrder", "RecordWriter", "RegenerateError",
    "RegenerateStats", "consolidate", "find_parts", "flatten", "iter_records", "make_provenance", "part_path",
    "plan_order", "provenance_differences", "record_id", "regenerate", "request_params", "request_seed",
    "scan_records",
]
