"""FlexPipe runtime: workers that carry out gear shifts under live traffic.

Pure, clock-free cores (router, throttle, transition state machine, engines, VMM accounting) are
driven by ``now_s`` inputs; :mod:`runtime.worker` and :mod:`runtime.http` wrap them with Kafka,
asyncio and aiohttp.
"""
