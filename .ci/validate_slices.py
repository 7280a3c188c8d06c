"""Validates the ResourceSlices `kerf inventory` prints, one file per mock profile and feature
set, as .ci/validate-manifests runs it.

Usage: validate_slices.py VERSIONS_OFF VERSIONS_ON FILE...

Each FILE is named `<profile>.<mode>.yaml`, mode one of `off` (no 1.36 feature),
`consumable-capacity`, `partitionable-devices` or `all` (both). Files of mode `off` are checked
against the Kubernetes versions VERSIONS_OFF (comma-separated), the others against
VERSIONS_ON only: the fields they use are beta and on by default from 1.36.

Three layers of checks:
1. The strict JSON schemas of the PyPI package kubernetes-validate (unknown fields, types).
2. What the schemas cannot say, after kube-apiserver's ResourceSlice validation
   (kubernetes/kubernetes pkg/apis/resource/validation/validation.go): validateResourceSliceSpec
   (only one of sharedCounters or devices; 128 devices, 64 when one has taints or consumes
   counters; at most 8 counter sets), validateDevice (at most 32 attributes and capacities,
   requestPolicy only with allowMultipleAllocations, at most 2 counter consumptions),
   validateDeviceAttribute (exactly one value, strings and versions at most 64 characters,
   versions semver), validateQualifiedName / validateCIdentifier (keys), validateCounterSet and
   validateDeviceCounterConsumption (DNS-label names, at most 32 counters),
   validateRequestPolicy, validateValidRequestValues, validateRequestPolicyValidValues,
   validateRequestPolicyRange and validateRequestPolicyRangeStep (a policy needs a default; the
   range's min, max, default and step against each other and the capacity's value).
3. The pool as a whole, the way the scheduler reads it: one driver, pool, node and generation,
   resourceSliceCount equal to the slices printed, unique slice, device and counter-set names,
   and every consumed counter present in a counter set of the pool with at least the amount
   consumed (kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/structured/
   internal/incubating/allocator_incubating.go, checkAvailableCounters: a device whose counter
   set is missing makes the pool incomplete, and one consuming more than the set holds never
   fits).

On top, the feature must show in its output, so that a flag doing nothing cannot pass: with
consumable capacity every shareable device is a whole GPU of the scheduler's with memory and
compute policies, the output without
features has no 1.36 field at all, and over all profiles the consumable-capacity output has
shareable devices and the partitionable-devices output counter sets.

Exits 1 with one `FAIL <file> (profile P, mode M): ...` line per problem.
"""

import json
import re
import sys
from fractions import Fraction
from importlib.resources import files as package_files

import jsonschema
import yaml
from referencing import Registry, Resource

API_VERSION = "resource.k8s.io/v1"
MODES = ("off", "consumable-capacity", "partitionable-devices", "all")

# pkg/apis/resource/types.go
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ID_LENGTH = 32
MAX_ATTRIBUTE_VALUE_LENGTH = 64
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_VALID_VALUES = 10

C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# validation.go semverRe
_NUM = r"(0|[1-9]\d*)"
_PRE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
SEMVER = re.compile(
    rf"^{_NUM}\.{_NUM}\.{_NUM}(-{_PRE}(\.{_PRE})*)?(\+{_BUILD}(\.{_BUILD})*)?$"
)

# k8s.io/apimachinery/pkg/api/resource/quantity.go: decimal SI, binary SI and exponent suffixes.
SUFFIXES = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}
QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))([eE][+-]?\d+|[numkMGTPE]i?|)$")


class Invalid(Exception):
    pass


def quantity(text, where):
    """A Kubernetes quantity as an exact fraction."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Fraction(text)
    match = QUANTITY.match(str(text))
    if not match or match.group(2) in ("ni", "ui", "mi"):
        raise Invalid(f"{where}: {text!r} is not a quantity")
    number, suffix = Fraction(match.group(1)), match.group(2)
    if suffix[:1] in ("e", "E"):
        return number * Fraction(10) ** int(suffix[1:])
    return number * SUFFIXES[suffix]


def value(q):
    """Quantity.Value(): rounded up to an integer, as validateRequestPolicyRangeStep uses it."""
    return -((-q.numerator) // q.denominator)


# --- 1. strict schemas ------------------------------------------------------------------------

def schema_dir(version):
    root = package_files("kubernetes_validate").joinpath("kubernetes-json-schema")
    path = root.joinpath(f"v{version}.0-local-strict")
    if not path.is_dir():
        sys.exit(f"kubernetes-validate has no schemas for Kubernetes {version}")
    return path


VALIDATORS = {}


def slice_validator(version):
    if version not in VALIDATORS:
        directory = schema_dir(version)
        with directory.joinpath("_definitions.json").open() as f:
            definitions = Resource.from_contents(json.load(f)) @ Registry()
        path = directory.joinpath("resourceslice-resource-v1.json")
        if not path.is_file():
            sys.exit(f"kubernetes-validate has no resource.k8s.io/v1 ResourceSlice for {version}")
        with path.open() as f:
            schema = json.load(f)
        VALIDATORS[version] = jsonschema.Draft202012Validator(
            schema, registry=Resource.from_contents(schema) @ definitions
        )
    return VALIDATORS[version]


def schema_errors(doc, version):
    errors = []
    for error in slice_validator(version).iter_errors(doc):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        errors.append(f"against Kubernetes {version}: {path or '.'}: {error.message}")
    return errors


# --- 2. kube-apiserver's validation the schemas leave out ---------------------------------------

def qualified_name_errors(name, where):
    parts = name.split("/")
    errors = []
    if len(parts) == 2:
        domain, name = parts
        if not domain or len(domain) > 63 or not DNS_SUBDOMAIN.match(domain):
            errors.append(f"{where}: domain {domain!r} is not a DNS subdomain of at most 63 characters")
    elif len(parts) != 1:
        errors.append(f"{where}: more than one '/'")
    if len(name) > MAX_ID_LENGTH or not C_IDENTIFIER.match(name):
        errors.append(f"{where}: {name!r} is not a C identifier of at most {MAX_ID_LENGTH} characters")
    return errors


def attribute_errors(attribute, where):
    kinds = [k for k in ("bool", "int", "string", "version") if k in attribute]
    if len(kinds) != 1:
        return [f"{where}: exactly one value must be specified, found {kinds}"]
    text = attribute.get("string", attribute.get("version"))
    errors = []
    if isinstance(text, str) and len(text) > MAX_ATTRIBUTE_VALUE_LENGTH:
        errors.append(f"{where}: longer than {MAX_ATTRIBUTE_VALUE_LENGTH} characters")
    if "version" in attribute and not SEMVER.match(str(attribute["version"])):
        errors.append(f"{where}.version: {attribute['version']!r} is not semver 2.0.0")
    return errors


def request_policy_errors(capacity_value, policy, where):
    """validateRequestPolicy and the functions it calls."""
    values = policy.get("validValues") or []
    valid_range = policy.get("validRange")
    if values and valid_range is not None:
        return [f"{where}: exactly one policy can be specified, not validValues and validRange"]
    if not values and valid_range is None:
        return []
    if "default" not in policy:
        what = "validValues" if values else "validRange"
        return [f"{where}.default: required when {what} is defined"]
    default = quantity(policy["default"], f"{where}.default")
    errors = []
    if values:
        parsed = [quantity(v, f"{where}.validValues[{i}]") for i, v in enumerate(values)]
        if len(parsed) > MAX_VALID_VALUES:
            return [f"{where}.validValues: {len(parsed)} values, at most {MAX_VALID_VALUES}"]
        for i in range(len(parsed) - 1):
            if parsed[i] > parsed[i + 1]:
                errors.append(f"{where}.validValues[{i + 1}]: values must be sorted in ascending order")
        if len({value(p) for p in parsed}) != len(parsed):
            errors.append(f"{where}.validValues: duplicate values")
        for i, option in enumerate(parsed):
            if option > capacity_value:
                errors.append(f"{where}.validValues[{i}]: option is larger than the capacity's value")
        if default not in parsed:
            errors.append(f"{where}.validValues: default {policy['default']} is not one of them")
        return errors
    at = f"{where}.validRange"
    if "min" not in valid_range:
        return [f"{at}.min: required when validRange is defined"]
    low = quantity(valid_range["min"], f"{at}.min")
    if low > capacity_value:
        errors.append(f"{at}.min: min is larger than the capacity's value")
    if default < low:
        errors.append(f"{at}.min: default {policy['default']} is less than min {valid_range['min']}")
    high = None
    if "max" in valid_range:
        high = quantity(valid_range["max"], f"{at}.max")
        if low > high:
            errors.append(f"{at}.max: min is larger than max")
        if high > capacity_value:
            errors.append(f"{at}.max: max is larger than the capacity's value")
        if default > high:
            errors.append(f"{at}.max: default {policy['default']} is more than max {valid_range['max']}")
    if "step" in valid_range:
        step = quantity(valid_range["step"], f"{at}.step")
        if low + step > capacity_value:
            errors.append(f"{at}.step: one step from min is larger than the capacity's value")
        if value(step) == 0:
            errors.append(f"{at}.step: zero")
        else:
            for name, q in (("default", default), ("max", high)):
                if q is not None and (value(q) - value(low)) % value(step) != 0:
                    errors.append(f"{at}.step: {name} is not a multiple of the step from min")
    return errors


def counters_errors(counters, limit, where):
    if not counters:
        return [f"{where}: required"]
    if len(counters) > limit:
        return [f"{where}: {len(counters)} counters, at most {limit}"]
    errors = []
    for name, counter in counters.items():
        if len(name) > 63 or not DNS_LABEL.match(name):
            errors.append(f"{where}[{name!r}]: not a DNS label")
        quantity((counter or {}).get("value"), f"{where}[{name!r}].value")
    return errors


def device_errors(device, where):
    errors = []
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        errors.append(f"{where}: {len(attributes) + len(capacity)} attributes and capacities, "
                      f"at most {MAX_ATTRIBUTES_AND_CAPACITIES}")
    for name, attribute in attributes.items():
        errors += qualified_name_errors(name, f"{where}.attributes[{name!r}]")
        errors += attribute_errors(attribute or {}, f"{where}.attributes[{name!r}]")
    shareable = device.get("allowMultipleAllocations") is True
    for name, cap in capacity.items():
        at = f"{where}.capacity[{name!r}]"
        errors += qualified_name_errors(name, at)
        total = quantity((cap or {}).get("value"), f"{at}.value")
        policy = (cap or {}).get("requestPolicy")
        if policy is None:
            continue
        if not shareable:
            errors.append(f"{at}.requestPolicy: forbidden, allowMultipleAllocations must be true")
            continue
        errors += request_policy_errors(total, policy, f"{at}.requestPolicy")
    consumptions = device.get("consumesCounters") or []
    if len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
        errors.append(f"{where}.consumesCounters: {len(consumptions)} entries, "
                      f"at most {MAX_CONSUMPTIONS_PER_DEVICE}")
    sets = [c.get("counterSet") for c in consumptions]
    if len(set(sets)) != len(sets):
        errors.append(f"{where}.consumesCounters: a counter set is named twice")
    for i, consumption in enumerate(consumptions):
        at = f"{where}.consumesCounters[{i}]"
        if not DNS_LABEL.match(consumption.get("counterSet") or ""):
            errors.append(f"{at}.counterSet: not a DNS label")
        errors += counters_errors(consumption.get("counters"), MAX_COUNTERS_PER_CONSUMPTION,
                                  f"{at}.counters")
    return errors


def slice_errors(spec):
    errors = []
    devices = spec.get("devices")
    counter_sets = spec.get("sharedCounters")
    if devices is not None and counter_sets is not None:
        errors.append("spec: only one of sharedCounters or devices is allowed")
    devices = devices or []
    advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if advanced else MAX_DEVICES
    if len(devices) > limit:
        errors.append(f"spec.devices: {len(devices)} devices, at most {limit}"
                      + (" when a device has taints or consumes counters" if advanced else ""))
    counter_sets = counter_sets or []
    if len(counter_sets) > MAX_COUNTER_SETS:
        errors.append(f"spec.sharedCounters: {len(counter_sets)} sets, at most {MAX_COUNTER_SETS}")
    for i, counter_set in enumerate(counter_sets):
        at = f"spec.sharedCounters[{i}]"
        if not DNS_LABEL.match(counter_set.get("name") or ""):
            errors.append(f"{at}.name: not a DNS label")
        errors += counters_errors(counter_set.get("counters"), MAX_COUNTERS_PER_SET, f"{at}.counters")
    for i, device in enumerate(devices):
        errors += device_errors(device, f"spec.devices[{i}]({device.get('name')})")
    return errors


# --- 3. the pool ------------------------------------------------------------------------------

def pool_errors(docs):
    errors = []
    specs = [d.get("spec") or {} for d in docs]
    for field, get in (
        ("spec.driver", lambda s: s.get("driver")),
        ("spec.nodeName", lambda s: s.get("nodeName")),
        ("spec.pool.name", lambda s: (s.get("pool") or {}).get("name")),
        ("spec.pool.generation", lambda s: (s.get("pool") or {}).get("generation")),
    ):
        seen = {json.dumps(get(s)) for s in specs}
        if len(seen) != 1:
            errors.append(f"{field}: the slices of the pool differ ({', '.join(sorted(seen))})")
    for s in specs:
        count = (s.get("pool") or {}).get("resourceSliceCount")
        if count != len(docs):
            errors.append(f"spec.pool.resourceSliceCount: {count}, but {len(docs)} slices are printed")
            break
    names = [(d.get("metadata") or {}).get("name") for d in docs]
    if len(set(names)) != len(names) or None in names:
        errors.append(f"metadata.name: slice names missing or not unique: {names}")
    device_names = [dev.get("name") for s in specs for dev in s.get("devices") or []]
    duplicates = sorted({n for n in device_names if device_names.count(n) > 1})
    if duplicates:
        errors.append(f"spec.devices: device names not unique in the pool: {duplicates}")
    counter_sets = {}
    for s in specs:
        for counter_set in s.get("sharedCounters") or []:
            name = counter_set.get("name")
            if name in counter_sets:
                errors.append(f"spec.sharedCounters: counter set {name!r} twice in the pool")
            counter_sets[name] = {
                k: quantity((v or {}).get("value"), f"counter set {name!r} counter {k!r}")
                for k, v in (counter_set.get("counters") or {}).items()
            }
    for s in specs:
        for device in s.get("devices") or []:
            for consumption in device.get("consumesCounters") or []:
                where = f"device {device.get('name')!r} consumesCounters[{consumption.get('counterSet')!r}]"
                available = counter_sets.get(consumption.get("counterSet"))
                if available is None:
                    errors.append(f"{where}: no counter set of that name in the pool")
                    continue
                for name, counter in (consumption.get("counters") or {}).items():
                    used = quantity((counter or {}).get("value"), f"{where}[{name!r}]")
                    if name not in available:
                        errors.append(f"{where}: counter {name!r} is not in the counter set")
                    elif used > available[name]:
                        errors.append(f"{where}: consumes {counter['value']} of {name!r}, "
                                      "more than the counter set holds")
    return errors


# --- the features show -------------------------------------------------------------------------

def devices_of(docs):
    return [dev for d in docs for dev in (d.get("spec") or {}).get("devices") or []]


def device_type(device):
    return ((device.get("attributes") or {}).get("type") or {}).get("string")


def feature_errors(mode, docs):
    devices = devices_of(docs)
    errors = []
    if mode == "off":
        for d in docs:
            if (d.get("spec") or {}).get("sharedCounters"):
                errors.append("sharedCounters without --partitionable-devices")
        for device in devices:
            if device.get("allowMultipleAllocations") or device.get("consumesCounters"):
                errors.append(f"device {device.get('name')!r}: a 1.36 field without a feature flag")
            if any("requestPolicy" in (c or {}) for c in (device.get("capacity") or {}).values()):
                errors.append(f"device {device.get('name')!r}: requestPolicy without a feature flag")
        return errors
    counters = any(d.get("consumesCounters") for d in devices) or any(
        (d.get("spec") or {}).get("sharedCounters") for d in docs)
    if mode == "consumable-capacity" and counters:
        errors.append("counters without --partitionable-devices")
    if mode == "partitionable-devices" and any(d.get("allowMultipleAllocations") for d in devices):
        errors.append("a shareable device without --consumable-capacity")
    if mode in ("consumable-capacity", "all"):
        # A GPU in MIG mode is published whole but not shareable (it runs nothing whole).
        for gpu in (d for d in devices if d.get("allowMultipleAllocations")):
            name = gpu.get("name")
            if device_type(gpu) != "gpu" or gpu.get("consumesCounters"):
                errors.append(f"device {name!r}: shareable, but not a whole GPU outside dynamic MIG")
            capacity = gpu.get("capacity") or {}
            for cap in ("memory", "compute"):
                if "requestPolicy" not in (capacity.get(cap) or {}):
                    errors.append(f"device {name!r}: capacity {cap!r} without requestPolicy")
            owner = ((gpu.get("attributes") or {}).get("allocator") or {}).get("string")
            if owner != "scheduler":
                errors.append(f"device {name!r}: allocator {owner!r}, expected 'scheduler'")
    if mode in ("partitionable-devices", "all"):
        for device in devices:
            owner = ((device.get("attributes") or {}).get("allocator") or {}).get("string")
            if device.get("consumesCounters") and owner != "scheduler":
                errors.append(f"device {device.get('name')!r}: consumes counters, allocator "
                              f"{owner!r}, expected 'scheduler'")
    return errors


# --- main ---------------------------------------------------------------------------------------

def load(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__.split("\n\n")[1])
    versions_off = sys.argv[1].split(",")
    versions_on = sys.argv[2].split(",")
    failures = 0
    checked = {v: 0 for v in dict.fromkeys(versions_off + versions_on)}
    counter_sets_seen = partitionable_files = shareable_seen = consumable_files = 0
    for path in sys.argv[3:]:
        base = path.rsplit("/", 1)[-1]
        profile, _, rest = base.partition(".")
        mode = rest.removesuffix(".yaml")
        label = f"{path} (profile {profile}, mode {mode})"
        if mode not in MODES:
            print(f"FAIL {label}: unknown mode; expected one of {', '.join(MODES)}")
            failures += 1
            continue
        try:
            docs = load(path)
        except yaml.YAMLError as e:
            print(f"FAIL {label}: not YAML: {e}")
            failures += 1
            continue
        errors = [] if docs else ["no ResourceSlice printed"]
        for doc in docs:
            what = f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"
            if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "ResourceSlice":
                errors.append(f"{what}: expected a {API_VERSION} ResourceSlice")
                continue
            for version in versions_off if mode == "off" else versions_on:
                checked[version] += 1
                errors += [f"{what} {e}" for e in schema_errors(doc, version)]
            try:
                errors += [f"{what}: {e}" for e in slice_errors(doc.get("spec") or {})]
            except Invalid as e:
                errors.append(f"{what}: {e}")
        if docs and all(d.get("kind") == "ResourceSlice" for d in docs):
            try:
                errors += [f"pool: {e}" for e in pool_errors(docs)]
            except Invalid as e:
                errors.append(f"pool: {e}")
            errors += feature_errors(mode, docs)
        if mode in ("partitionable-devices", "all"):
            partitionable_files += 1
            counter_sets_seen += sum(len((d.get("spec") or {}).get("sharedCounters") or []) for d in docs)
        if mode in ("consumable-capacity", "all"):
            consumable_files += 1
            shareable_seen += sum(1 for d in devices_of(docs) if d.get("allowMultipleAllocations"))
        for error in errors:
            print(f"FAIL {label}: {error}")
        failures += len(errors)
    if consumable_files and not shareable_seen:
        print("FAIL consumable-capacity: no profile's output has a shareable device "
              "(--consumable-capacity published no scheduler slice)")
        failures += 1
    if partitionable_files and not counter_sets_seen:
        print("FAIL partitionable-devices: no profile's output has a counter set "
              "(--partitionable-devices published no dynamic-MIG GPU)")
        failures += 1
    for version, count in checked.items():
        print(f"ResourceSlices against Kubernetes {version}: {count} checked")
    if failures:
        print(f"validate-slices: {failures} problem(s) in {len(sys.argv) - 3} files")
        sys.exit(1)
    print(f"validate-slices: the slices of {len(sys.argv) - 3} files are valid")


if __name__ == "__main__":
    main()
