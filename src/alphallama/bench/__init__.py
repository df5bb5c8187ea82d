"""The arena harness: one protocol, one prompt suite and one streaming client for any
OpenAI-compatible server (ours, llama-server, Ollama, vLLM).

Modules, in the order data flows through them:
  suite     the prompt suite (the public one ships in `suites/`)
  arms      an arm = a running server's URL or a command that starts one
  schedule  the order of requests: passes, reversed second pass, arm interleaving
  sse, client   the streaming client and what it measures per request
  runner    runs a schedule against the arms, starting and stopping servers
  stats     per-prompt means, pass agreement, geometric means, Speed Index
  hostinfo  GPU / host / git state recorded with every result
  report, plots   the JSON, Markdown and PNG outputs
  arena     the `alphallama bench` command
  stub      a scripted OpenAI server for tests and dry runs
"""
