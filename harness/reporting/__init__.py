"""What a run shows: the result table, JSON/JUnit, the HTML report and its charts, traces,
comparisons."""
