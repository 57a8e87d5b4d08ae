"""verl's rule scorers as keel reproduces them: the routing table of data sources (`routing`), the
math rules (`verl_math`, `prime_math`, with `prime_math_compare` and `literals`), the QA rule (`qa`)
and the code tests (`code_tests`). Nothing here imports the registry that names them
(keel/rewards/registry.py)."""
