"""The ranges a sampler serves: ``SamplingParams`` checks them, and the OpenAI schema takes its bounds
from them (narrowing two for its clients). Free of torch: the gate, which has no torch,
documents its routes with the schema's models."""

MIN_TEMPERATURE = 0.0
MAX_TOP_P = 1.0  # top_p in (0, MAX_TOP_P]: at 0 no token would be kept
SEED_LIMIT = 2**63  # seed in [0, SEED_LIMIT): torch's generators take a signed 64-bit seed
