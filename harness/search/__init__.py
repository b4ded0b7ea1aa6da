"""``aftershock explore``: searching fault schedules, and the Hypothesis strategies behind
it."""
