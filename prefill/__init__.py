"""Prefill worker: computes prompts' KV (reusing its own radix cache), pushes it layer by layer
to the decode worker that reserved blocks for it, and returns the first token
(tandem.v1.PrefillWorker). Entry point: `tandem prefill` (`entrypoints.worker.prefill_main`)."""
