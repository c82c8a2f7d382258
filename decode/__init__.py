"""Decode worker: reserves KV blocks for prompts a prefill worker pushes, then decodes them in
its running batch (tandem.v1.DecodeWorker). Role `both` serves the same service and prefills
locally through PrefillAndDecode. Entry point: `tandem decode` (`entrypoints.worker.decode_main`)."""
