"""``python -m grader report`` counts an assignment as measured only when it has a measured table."""

from grader.analysis import measured


def test_an_assignment_whose_every_row_is_a_todo_is_not_measured():
    assert not measured({"todo": "TODO 1.1: ..."})
    assert not measured({"error": "ValueError: ..."})
    assert not measured({"rows": [{"strategy": "dp", "todo": "TODO 2.1"}, {"strategy": "dp-bucketed", "todo": "x"}]})
    assert measured({"rows": [{"strategy": "dp", "todo": "TODO 2.1"}, {"strategy": "dp-bucketed", "sent_total": 8}]})
    assert not measured({"rows": {"bubbles": [], "steps": [{"strategy": "pp-1f1b", "todo": "TODO 5.3"}]}})
    assert measured({"rows": {"bubbles": [{"schedule": "gpipe"}], "steps": [{"strategy": "pp", "todo": "x"}]}})
