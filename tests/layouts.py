"""The layouts the tests prove, owned by the tests (not read from the bench they check):
each strategy of the bench's table on 8 devices, by name -> its overrides."""

STRATEGIES = {
    "dp8-zero0": ("parallel.data=8", "parallel.zero=0"),
    "dp8-zero1": ("parallel.data=8", "parallel.zero=1"),
    "dp8-zero2": ("parallel.data=8", "parallel.zero=2"),
    "dp8-zero3": ("parallel.data=8", "parallel.zero=3"),
    "dp4-tp2-zero0": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=0"),
    "dp4-tp2-zero3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
    "dp2-tp4-zero2": ("parallel.data=2", "parallel.tensor=4", "parallel.zero=2"),
    "tp8": ("parallel.data=1", "parallel.tensor=8"),
}
