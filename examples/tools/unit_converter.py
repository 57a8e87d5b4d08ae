"""A custom tool for examples/tools/tools.yaml: keel's Tool contract is verl's BaseTool,
synchronous. `execute(parameters, **execute_kwargs)` returns the text the model reads (or text,
reward, metrics); whatever it raises is fed back to the model as an error and counted, never
fatal."""

from keel.rollout.agent import Tool

FACTORS = {
    ("km", "mi"): 0.621371,
    ("mi", "km"): 1.609344,
    ("kg", "lb"): 2.204623,
    ("lb", "kg"): 0.453592,
}


class UnitConverter(Tool):
    def execute(self, parameters: dict, **execute_kwargs) -> str:
        value, source, target = float(parameters["value"]), parameters["from"], parameters["to"]
        if (source, target) not in FACTORS:
            raise ValueError(f"cannot convert {source} to {target}; known: {sorted(FACTORS)}")
        return f"{value * FACTORS[source, target]:.{self.config.get('digits', 3)}f} {target}"
