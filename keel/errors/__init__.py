"""The catalogue of every error a user can cause, and the exception that carries one.

Each code is `KEEL-<area><nnn>`: E environment, C configuration, M model/tokenizer, D data,
R reward, T training numerics, P parallel/distributed; each area's codes live in its module
here, and anything in keel may import them from `keel.errors`. `keel explain CODE` prints an
entry.
"""

from keel.errors.base import CATALOGUE, Code, KeelError, SkipStep, explain, register  # noqa: F401

# Each area's code constants, registered in catalogue order: the order is meant, not sorted.
# isort: off
from keel.errors.config import *  # noqa: E402, F401, F403
from keel.errors.model import *  # noqa: E402, F401, F403
from keel.errors.data import *  # noqa: E402, F401, F403
from keel.errors.reward import *  # noqa: E402, F401, F403
from keel.errors.training import *  # noqa: E402, F401, F403
from keel.errors.environment import *  # noqa: E402, F401, F403
from keel.errors.parallel import *  # noqa: E402, F401, F403
# isort: on
