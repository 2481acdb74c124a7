"""The engine: what runs inside one stage's process (design sections 1, 2 and 5b).

- `stage`: the role every stage kind plays (`Stage`, `Session`: open a request, feed it tokens)
- `runner`: `StageRunner`, the asyncio loop that drives one stage over its links
- `request_protocol`: one request's side of the protocol, a state machine: messages and outcomes in,
  messages and the next forward out
- `request_state`: what a request's protocol keeps, split by role
- `predrafting`: the hooks where a request's protocol plans, grows and cashes pre-drafted branches
- `early_mail`: messages that overtook their request's Open, held until it comes
- `patience`: when a verifier waits for its drafter instead of generating itself
- `verify_budget`: how many of its drafts each request of a batched verification checks (those that pay)
- `outcome_cache`: branches a waiting drafter pre-drafts for the verdicts it expects
- `step`: one forward of one stage, planned on the loop and run on the compute thread
- `scheduler`: `DeviceScheduler`, one device's compute thread shared by its stages
- `affinity`: which cores this process's threads run on (a device's, and a baseline measured beside it)
- `choice`, `sampling`, `noise`: how logits become tokens (greedy, coupled, rejection), exactly alike
  on every stage
- `draft_tree`, `tree_drafting`, `tree_verification`: draft trees, how a drafter grows one (EAGLE-2's dynamic
  tree) and how a verifier takes a path of it (exact match; token-level or Traversal Verification)
- `handoff`: the target-to-DREAM feature handoff
- `trace`: where a stage's time goes, step by step
- `synchronous`: synchronous speculative decoding, the baseline the pipeline must beat

Importing the package imports nothing: torch loads with the modules that need it.
"""
