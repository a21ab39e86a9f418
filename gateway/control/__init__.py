"""Control loops that steer the fleet: autoscaling and its actuators, model pooling and turns, re-planning."""
