"""Self-distillation: replace every assistant turn with the target's own answer.

Multi-turn conversations are regenerated turn by turn: answer k is generated from the regenerated
answers 0..k-1, so the training data is what the target would produce in that conversation
(`ConversationJob`). A backend runs the jobs; `regenerate()` only sees its records:
  * `local` (`eagle.regenerate.local.LocalBackend`): an HF model in this process, with one of two engines:
    `continuous` (default; `eagle.decode.continuous`: a slot freed by a finished conversation takes the
    next one at once, conversations in order of prompt length) or `generate` (a batch advances one
    assistant turn per round with left-padded HF `generate` calls);
  * `server` (`eagle.regenerate.server.ServerBackend`, engines in `eagle.regenerate.engines`): OpenAI-compatible servers answering raw completions
    of the prompts rendered here.
Each assistant message holds its text (the ids' decoding, stripped) and, where the ids are known (the
local engines; servers whose engine returns them), the generated ids (`"token_ids"`, end-of-turn token
excluded). Training tokenises an answer as these ids, not as a re-tokenisation of its text, which
differs for many answers (`eagle.data.template`).

Reasoning targets (`regenerate.reasoning`): the thinking the target writes before its `</think>` is split
off its answer and stored as `reasoning_content` (keep), left out (drop), or not asked for (off: the
prompt rendered with the template's `enable_thinking=False`). A split answer keeps no token ids (its
ids hold both parts; training tokenises the rendered text). Tool calls and results of the source
conversation are replayed as they are (never executed: a tool-calling turn is kept verbatim with its
results); the answers after them are regenerated.

Output: JSONL, one `{"id", "messages"}` record (OpenAI format) per conversation, readable by
`data=local data.path=...`, in the order conversations finish. Resumable: records are appended as
they finish with flush+fsync;
a restart skips ids already written, drops a torn last line left by a hard kill, and refuses to mix
outputs of different targets, backends, served models, generation settings or data (recorded in
`<output>.meta.json`; each differing key is named with both values). A changed selection
(`data.max_conversations`, `data.dedup_against`) is allowed and noted: it adds or leaves out
conversations, not other answers.

Modules: `job` (one conversation replayed), `local` and `server` (+ `engines`) (the backends), `output` (the
file and its meta record), `runner` (`regenerate()` and the `eagle-regenerate` stage).
"""
