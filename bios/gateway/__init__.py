"""The Tinker-compatible HTTP API: the official `tinker` SDK and tinker-cookbook run against Bios unchanged.

    bios-coordinator --http 127.0.0.1:8000 ...
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-anything python train.py

It needs the `tinker` extra (`pip install 'bios[tinker]'`): the gateway reads and writes the SDK's own protobuf
schema. `server.start_gateway` runs it inside the coordinator process; `GatewayConfig.from_env` lists its knobs.
"""
