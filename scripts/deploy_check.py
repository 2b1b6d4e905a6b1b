"""The two checks of scripts/deploy_check.sh that need Python (its
virtualenv: kubernetes-validate, with PyYAML).

  deploy_check.py alert-tests ALERTS.yaml TESTS.yaml
      Every alert of ALERTS.yaml has, in TESTS.yaml (a `promtool test
      rules` file), an alert_rule_test that expects it firing and one that
      expects it silent; every alert TESTS.yaml names exists.

  deploy_check.py manifests RENDERED.yaml
      Every object of RENDERED.yaml (`kubectl kustomize` output) is valid,
      strictly (no unknown field), against the Kubernetes schemas of every
      version kubernetes-validate bundles. A kind with no schema there is an
      error, not the library's warning.

Exits 1 with what is wrong on stderr.
"""

import sys

import yaml


def alert_tests(alerts_path, tests_path):
    alerts = [
        rule["alert"]
        for group in yaml.safe_load(open(alerts_path))["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]
    firing, silent = set(), set()
    for test in yaml.safe_load(open(tests_path))["tests"]:
        for case in test.get("alert_rule_test") or []:
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    problems = []
    for alert in alerts:
        if alert not in firing:
            problems.append(f"{alert}: no test expects it to fire")
        if alert not in silent:
            problems.append(f"{alert}: no test expects it not to fire")
    for name in sorted((firing | silent) - set(alerts)):
        problems.append(f"{name}: tested, but not an alert of {alerts_path}")
    for p in problems:
        print(f"{tests_path}: {p}", file=sys.stderr)
    if not problems:
        print(f"{tests_path}: each of the {len(alerts)} alerts fires in a test and stays silent in another")
    return not problems


def manifests(rendered_path):
    import kubernetes_validate
    from kubernetes_validate import utils

    objects = [o for o in yaml.safe_load_all(open(rendered_path)) if o]
    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    # Each problem once, with the versions it was found in.
    found = {}
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
                continue
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path) or "(the object)"
                problem = f"{name}: {path}: {e.message}"
            except kubernetes_validate.SchemaNotFoundError:
                problem = f"{name}: no schema for kind {obj.get('kind')} of {obj.get('apiVersion')}"
            found.setdefault(problem, []).append(version)
    problems = [f"{p} (Kubernetes {', '.join(vs)})" for p, vs in found.items()]
    if not objects:
        problems.append("no objects")
    for p in problems:
        print(f"{rendered_path}: {p}", file=sys.stderr)
    if not problems:
        kinds = ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
        print(
            f"{len(objects)} objects valid (strict) against Kubernetes {versions[0]} to "
            f"{versions[-1]} (kubernetes-validate {kubernetes_validate.__version__}): {kinds}"
        )
    return not problems


if __name__ == "__main__":
    commands = {"alert-tests": (alert_tests, 2), "manifests": (manifests, 1)}
    if len(sys.argv) < 2 or sys.argv[1] not in commands or len(sys.argv) - 2 != commands[sys.argv[1]][1]:
        sys.exit(__doc__)
    command, _ = commands[sys.argv[1]]
    sys.exit(0 if command(*sys.argv[2:]) else 1)
