"""Exit statuses of a test run that the harness aborted (``mpirun`` passes ``MPI_Abort``'s code on).

``python -m grader`` tells them apart from pytest's own statuses (0 all passed, 1 some failed,
2 interrupted, 5 none collected) and from a run killed by a signal.
"""

EXIT_ERROR = 86  # an exception escaped the harness on some rank (printed once, with the rank)
EXIT_DEADLINE = 87  # a test ran past TINYTRAIN_TEST_TIMEOUT (a hang): every rank printed its stacks

# The words a rank prints when its test ran past TINYTRAIN_TEST_TIMEOUT (before its stacks): the
# grader, seeing them, knows the harness is ending the test itself and waits for it.
DEADLINE_BANNER = "(TINYTRAIN_TEST_TIMEOUT): a hang or an endless loop"
# What a rank prints at that deadline when it had itself raised in the test (while another rank hung):
# its exception, its type and where, which the grader puts first in the hung test's message.
RAISED_BEFORE_HANG = "=== tinytrain harness, rank {rank}: before the deadline, this rank's test had raised: "

# The grader's budget for one test (``python -m grader --timeout``) and the harness's share of it:
# a graded test ends at the same deadline under ``mpirun -n 4 pytest`` as under the grader.
GRADER_BUDGET = 60.0
HARNESS_SHARE = 0.7
GRADED_DEADLINE = HARNESS_SHARE * GRADER_BUDGET
