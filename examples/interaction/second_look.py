"""A simulated user in verl's interaction protocol: after the model's first answer it asks for a
second look, once (config max_nudges), then ends the episode. Async methods, as verl's are; keel
runs them on one event loop, one instance shared by every episode, each episode its instance id."""


class SecondLook:
    def __init__(self, config: dict):
        self.max_nudges = int(config.get("max_nudges", 1))
        self.nudges: dict[str, int] = {}

    async def start_interaction(self, instance_id: str, **interaction_kwargs) -> str:
        self.nudges[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict], **interaction_kwargs):
        """-> (end the episode?, the user's reply, a score for this turn, metrics)."""
        if self.nudges[instance_id] >= self.max_nudges:
            return True, "Thanks.", 0.0, {}
        self.nudges[instance_id] += 1
        return False, "Look again, then answer.", 0.0, {}

    async def finalize_interaction(self, instance_id: str, **interaction_kwargs) -> None:
        del self.nudges[instance_id]
