"""``make bench-soak`` and ``make bench-chaos`` (issue #16), one concept per module: ``platform`` starts the
local platform and reads its processes and Redis, ``proxy`` is the Service in front of two gateways,
``soak`` judges a soak's windows and ``chaos`` schedules the kills and classifies each request (both pure)."""
