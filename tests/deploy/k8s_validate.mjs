// Validates the rendered manifests of deploy/k8s (render.sh's OUTDIR/NAME.yaml for base, gpu,
// cpu, sharded-4 and mtls): every object against the Kubernetes API schemas (npm
// kubernetes-models), the Prometheus-operator CRD schemas (npm
// @kubernetes-models/prometheus-operator) or cert-manager's (npm @kubernetes-models/cert-manager),
// then what the schemas cannot say: names the API server would refuse, how the objects must
// agree with each other and with fusedps-server (ports, probes, drain time, flags, security,
// volumes, certificates, network policy), and that the sharded example is what
// docs/operations/deploy.md says: 4 shards in sync mode, reached at the headless Service's stable
// names. The example trainers of deploy/k8s/examples are checked too.
//
//   node --test k8s_validate.mjs      with FUSEDPS_RENDERED=OUTDIR and FUSEDPS_SOURCE_DIR=repo
import assert from "node:assert/strict";
import { existsSync, readFileSync, readdirSync, statSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { isDeepStrictEqual } from "node:util";
import { parseAllDocuments, parse as parseYaml } from "yaml";

const renderedDir = process.env.FUSEDPS_RENDERED;
const sourceDir = process.env.FUSEDPS_SOURCE_DIR;
assert.ok(renderedDir && sourceDir, "set FUSEDPS_RENDERED and FUSEDPS_SOURCE_DIR");

const GRPC_SERVICE = "fusedps.v1.ParameterService";
const CHECKPOINT_DIR = "/var/lib/fusedps";
const PROBES = ["startupProbe", "livenessProbe", "readinessProbe"];

function loadObjects(name) {
  const text = readFileSync(join(renderedDir, `${name}.yaml`), "utf8");
  return parseAllDocuments(text)
    .map((doc) => {
      assert.equal(doc.errors.length, 0, `${name}.yaml: ${doc.errors.join("; ")}`);
      return doc.toJS();
    })
    .filter((object) => object !== null);
}

// apiVersion "apps/v1" -> kubernetes-models/apps/v1; "v1" -> kubernetes-models/v1;
// monitoring.coreos.com/* -> @kubernetes-models/prometheus-operator; cert-manager.io/* ->
// @kubernetes-models/cert-manager.
async function modelFor(apiVersion, kind) {
  const module = apiVersion.startsWith("monitoring.coreos.com/")
    ? await import(`@kubernetes-models/prometheus-operator/${apiVersion}`)
    : apiVersion.startsWith("cert-manager.io/")
      ? await import(`@kubernetes-models/cert-manager/${apiVersion}`)
      : await import(`kubernetes-models/${apiVersion}`);
  assert.ok(module[kind], `no schema for ${apiVersion} ${kind}`);
  return module[kind];
}

const DNS_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const DNS_SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const LABEL_VALUE = /^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$/;
const PORT_NAME = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/; // IANA_SVC_NAME, at most 15 characters

// Rules of the API server's own validation that the OpenAPI schemas leave out.
function checkNames(object) {
  const where = `${object.kind} ${object.metadata.name}`;
  const nameRule = ["Service", "StatefulSet"].includes(object.kind) ? DNS_LABEL : DNS_SUBDOMAIN;
  assert.match(object.metadata.name, nameRule, `${where}: invalid name`);
  assert.ok(object.metadata.name.length <= (object.kind === "Service" ? 63 : 253), where);
  for (const [key, value] of Object.entries(object.metadata.labels ?? {})) {
    const [prefix, name] = key.includes("/") ? key.split("/") : [null, key];
    if (prefix !== null) assert.match(prefix, DNS_SUBDOMAIN, `${where}: label key ${key}`);
    assert.match(name, /^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$/, `${where}: label key ${key}`);
    assert.ok(name.length <= 63 && value.length <= 63, `${where}: label ${key} too long`);
    assert.match(value, LABEL_VALUE, `${where}: label value ${key}=${value}`);
  }
  const ports = [
    ...(object.spec?.ports ?? []),
    ...(object.spec?.template?.spec?.containers ?? []).flatMap((c) => c.ports ?? []),
  ];
  for (const port of ports) {
    if (port.name === undefined) continue;
    assert.match(port.name, PORT_NAME, `${where}: port name ${port.name}`);
    assert.ok(port.name.length <= 15 && /[a-z]/.test(port.name), `${where}: port ${port.name}`);
  }
}

function selectorMatches(selector, labels) {
  return Object.entries(selector).every(([key, value]) => labels[key] === value);
}

function only(objects, kind) {
  const found = objects.filter((object) => object.kind === kind);
  assert.equal(found.length, 1, `expected one ${kind}, found ${found.length}`);
  return found[0];
}

// The container's arguments with $(VAR) replaced from its env and envFrom ConfigMaps, as the
// kubelet does.
function resolvedArgs(objects, container) {
  const env = {};
  for (const source of container.envFrom ?? []) {
    const map = objects.find(
      (o) => o.kind === "ConfigMap" && o.metadata.name === source.configMapRef?.name,
    );
    assert.ok(map, `envFrom names ConfigMap ${source.configMapRef?.name}, not in the output`);
    Object.assign(env, map.data);
  }
  for (const variable of container.env ?? []) env[variable.name] = variable.value;
  return [...(container.command ?? []), ...(container.args ?? [])].map((arg) =>
    arg.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (_, name) => {
      assert.ok(name in env, `argument ${arg}: $(${name}) is not set`);
      return env[name];
    }),
  );
}

function flagValue(args, flag) {
  const values = args.filter((a) => a.startsWith(`--${flag}=`)).map((a) => a.split("=")[1]);
  assert.ok(values.length <= 1, `--${flag} given twice`);
  return values[0];
}

const portOf = (address) => Number(address.slice(address.lastIndexOf(":") + 1));
const hostOf = (address) => address.slice(0, address.lastIndexOf(":"));

// The Secret volume mounted (as a directory: a subPath mount never sees the Secret's updates)
// at the directory that holds `path`: { mount, volume }.
function secretMountOf(pod, container, path, what) {
  const mount = (container.volumeMounts ?? []).find((m) => path.startsWith(`${m.mountPath}/`));
  assert.ok(mount, `${what} ${path}: no volume is mounted there`);
  assert.equal(mount.subPath, undefined, `${what}: mount ${mount.name} with subPath`);
  assert.equal(path.slice(mount.mountPath.length + 1).includes("/"), false, `${what} ${path}`);
  const volume = pod.volumes.find((v) => v.name === mount.name);
  assert.ok(volume?.secret, `${what} ${path}: volume ${mount.name} is not a Secret`);
  return { mount, volume };
}

// "2s" -> 2.
function seconds(duration) {
  const match = /^(\d+(?:\.\d+)?)s$/.exec(duration ?? "");
  assert.ok(match, `duration ${duration}`);
  return Number(match[1]);
}

function readRuleFiles() {
  const dir = join(sourceDir, "deploy/prometheus/rules");
  return readdirSync(dir)
    .filter((f) => /\.ya?ml$/.test(f))
    .map((f) => ({ file: f, rules: parseYaml(readFileSync(join(dir, f), "utf8")) }));
}

for (const variant of ["base", "gpu", "cpu", "sharded-4", "mtls"]) {
  const objects = loadObjects(variant);

  test(`${variant}: every object validates against its API schema`, async () => {
    const kinds = new Set(objects.map((o) => o.kind));
    for (const kind of ["StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget",
      "NetworkPolicy"]) {
      assert.ok(kinds.has(kind), `${kind} missing`);
    }
    if (variant !== "base") {
      for (const kind of ["PodMonitor", "PrometheusRule"]) assert.ok(kinds.has(kind), kind);
    }
    for (const object of objects) {
      const Model = await modelFor(object.apiVersion, object.kind);
      assert.doesNotThrow(
        () => new Model(object).validate(),
        `${object.kind} ${object.metadata?.name} fails its schema`,
      );
      checkNames(object);
    }
  });

  test(`${variant}: the schema check rejects a broken object (it is not a no-op)`, async () => {
    const sts = structuredClone(only(objects, "StatefulSet"));
    sts.spec.template.spec.containers[0].readinessProbe.periodSeconds = "5";
    const Model = await modelFor(sts.apiVersion, sts.kind);
    assert.throws(() => new Model(sts).validate(), /must be integer/);
  });

  test(`${variant}: StatefulSet, headless Service and PodDisruptionBudget agree`, () => {
    const sts = only(objects, "StatefulSet");
    const service = only(objects, "Service");
    const pdb = only(objects, "PodDisruptionBudget");
    const podLabels = sts.spec.template.metadata.labels;
    assert.equal(sts.spec.serviceName, service.metadata.name, "serviceName is the headless Service");
    assert.equal(service.spec.clusterIP, "None", "the Service is headless");
    assert.ok(selectorMatches(sts.spec.selector.matchLabels, podLabels));
    assert.ok(selectorMatches(service.spec.selector, podLabels), "Service selects the pods");
    assert.ok(selectorMatches(pdb.spec.selector.matchLabels, podLabels), "PDB selects the pods");
    assert.equal(pdb.spec.maxUnavailable, 1);
    assert.ok(sts.spec.replicas >= 1);
    assert.equal(sts.spec.updateStrategy.type, "RollingUpdate");
    const container = sts.spec.template.spec.containers[0];
    const containerPorts = Object.fromEntries(container.ports.map((p) => [p.name, p.containerPort]));
    for (const port of service.spec.ports) {
      assert.ok(port.targetPort in containerPorts, `Service port ${port.name} -> ${port.targetPort}`);
      assert.equal(port.port, containerPorts[port.targetPort]);
    }
  });

  // The kubelet's own gRPC probe cannot speak TLS: the probes run the image's fusedps CLI
  // (`fusedps health`), over TLS when the port serves it. test_server_args.py runs them.
  test(`${variant}: listen flags, container ports and health probes agree`, () => {
    const sts = only(objects, "StatefulSet");
    const pod = sts.spec.template.spec;
    const container = pod.containers[0];
    const args = resolvedArgs(objects, container);
    assert.equal(args[0], "fusedps-server");
    const ports = Object.fromEntries(container.ports.map((p) => [p.name, p.containerPort]));
    assert.equal(ports.grpc, 50051);
    assert.equal(ports.metrics, 9464);
    assert.equal(portOf(flagValue(args, "listen")), ports.grpc, "--listen port is port grpc");
    assert.equal(portOf(flagValue(args, "metrics-listen")), ports.metrics, "--metrics-listen");
    const tls = flagValue(args, "tls-cert") !== undefined;
    const mtls = flagValue(args, "tls-client-ca") !== undefined;
    for (const probe of PROBES) {
      const command = container[probe]?.exec?.command;
      assert.ok(command, `${probe} is an exec probe`);
      assert.deepEqual(command.slice(0, 2), ["fusedps", "health"], `${probe}: ${command}`);
      const target = flagValue(command, "target");
      assert.equal(portOf(target), ports.grpc, `${probe} asks the gRPC port`);
      assert.ok(["localhost", "127.0.0.1"].includes(hostOf(target)), `${probe}: ${target}`);
      assert.ok(seconds(flagValue(command, "timeout")) < container[probe].timeoutSeconds,
        `${probe}: the CLI's --timeout must end before the probe's timeoutSeconds`);
      if (tls) {
        const ca = flagValue(command, "tls-ca");
        assert.ok(ca, `${probe}: the port serves TLS, so the probe needs --tls-ca`);
        secretMountOf(pod, container, ca, `${probe} --tls-ca`);
      }
      if (mtls) {
        // The pod's own certificate, which the server's CA signed.
        assert.equal(flagValue(command, "tls-cert"), flagValue(args, "tls-cert"), probe);
        assert.equal(flagValue(command, "tls-key"), flagValue(args, "tls-key"), probe);
      }
    }
    // Liveness asks about the server as a whole, readiness about the parameter service.
    const service = (probe) => flagValue(container[probe].exec.command, "service") ?? "";
    assert.equal(service("livenessProbe"), "");
    assert.equal(service("startupProbe"), "");
    assert.equal(service("readinessProbe"), GRPC_SERVICE);
  });

  test(`${variant}: TLS and tokens from Secrets, mounted as directories`, () => {
    const sts = only(objects, "StatefulSet");
    const pod = sts.spec.template.spec;
    const container = pod.containers[0];
    const args = resolvedArgs(objects, container);
    // Security is on in the base, so in every variant (docs/operations/security.md).
    const files = {};
    for (const flag of ["tls-cert", "tls-key", "auth-tokens", "tls-client-ca"]) {
      const path = flagValue(args, flag);
      if (flag === "tls-client-ca" && path === undefined) continue;
      assert.ok(path, `--${flag} is not set`);
      files[flag] = { path, ...secretMountOf(pod, container, path, `--${flag}`) };
      assert.equal(files[flag].mount.readOnly, true, `--${flag}: mount read-only`);
    }
    // cert-manager's layout of a kubernetes.io/tls Secret: tls.crt, tls.key, ca.crt.
    const tlsSecret = files["tls-cert"].volume.secret.secretName;
    assert.ok(files["tls-cert"].path.endsWith("/tls.crt"));
    assert.ok(files["tls-key"].path.endsWith("/tls.key"));
    assert.equal(files["tls-key"].volume.secret.secretName, tlsSecret);
    if (files["tls-client-ca"]) {
      assert.ok(files["tls-client-ca"].path.endsWith("/ca.crt"));
      assert.equal(files["tls-client-ca"].volume.secret.secretName, tlsSecret);
    }
    assert.ok(files["auth-tokens"].path.endsWith("/tokens"));
    assert.notEqual(files["auth-tokens"].volume.secret.secretName, tlsSecret);
    // Not readable by other users (the server reads them through fsGroup).
    for (const { volume } of Object.values(files)) {
      assert.equal(volume.secret.defaultMode & 0o007, 0, `${volume.name}: world-readable`);
    }
    assert.ok(pod.securityContext.fsGroup > 0);
    const reload = Number(flagValue(args, "credentials-reload-seconds"));
    assert.ok(reload > 0 && reload <= 60, `--credentials-reload-seconds=${reload}`);
  });

  test(`${variant}: the NetworkPolicy opens gRPC, and metrics to Prometheus only`, () => {
    const policy = only(objects, "NetworkPolicy");
    const sts = only(objects, "StatefulSet");
    const podLabels = sts.spec.template.metadata.labels;
    assert.ok(selectorMatches(policy.spec.podSelector.matchLabels, podLabels));
    assert.deepEqual(policy.spec.policyTypes, ["Ingress"]);
    const portNames = sts.spec.template.spec.containers[0].ports.map((p) => p.name);
    const rules = (port) =>
      policy.spec.ingress.filter((r) => r.ports?.some((p) => p.port === port));
    for (const rule of policy.spec.ingress) {
      for (const port of rule.ports ?? []) assert.ok(portNames.includes(port.port), port.port);
    }
    assert.equal(rules("grpc").length, 1, "one rule for port grpc");
    // The metrics port is plain HTTP without authentication: never open to everyone.
    const metrics = rules("metrics");
    assert.ok(metrics.length >= 1, "Prometheus must reach port metrics");
    for (const rule of metrics) {
      assert.ok(rule.from?.length > 0, "port metrics open to every source");
      for (const peer of rule.from) {
        assert.equal(peer.ipBlock, undefined, "metrics from an ipBlock");
        assert.ok(peer.podSelector?.matchLabels && peer.namespaceSelector?.matchLabels,
          "metrics only from selected pods in selected namespaces");
      }
    }
  });

  test(`${variant}: the pod outlives the server's drain on SIGTERM`, () => {
    const sts = only(objects, "StatefulSet");
    const args = resolvedArgs(objects, sts.spec.template.spec.containers[0]);
    const grace = Number(flagValue(args, "shutdown-grace-seconds") ?? 30);
    const period = sts.spec.template.spec.terminationGracePeriodSeconds;
    assert.ok(Number.isInteger(grace) && grace > 0, `--shutdown-grace-seconds=${grace}`);
    assert.ok(period >= grace + 10, `terminationGracePeriodSeconds ${period} < drain ${grace} + 10`);
  });

  test(`${variant}: non-root, read-only root filesystem, no privileges`, () => {
    const pod = only(objects, "StatefulSet").spec.template.spec;
    const container = pod.containers[0];
    assert.equal(pod.securityContext.runAsNonRoot, true);
    assert.ok(pod.securityContext.runAsUser > 0);
    assert.equal(pod.securityContext.seccompProfile.type, "RuntimeDefault");
    assert.equal(pod.automountServiceAccountToken, false);
    assert.equal(container.securityContext.readOnlyRootFilesystem, true);
    assert.equal(container.securityContext.allowPrivilegeEscalation, false);
    assert.deepEqual(container.securityContext.capabilities.drop, ["ALL"]);
  });

  test(`${variant}: a persistent volume per shard at ${CHECKPOINT_DIR}`, () => {
    const sts = only(objects, "StatefulSet");
    const mount = sts.spec.template.spec.containers[0].volumeMounts.find(
      (m) => m.mountPath === CHECKPOINT_DIR,
    );
    assert.ok(mount, `nothing mounted at ${CHECKPOINT_DIR}`);
    const claim = sts.spec.volumeClaimTemplates.find((t) => t.metadata.name === mount.name);
    assert.ok(claim, `${mount.name} is a volumeClaimTemplate`);
    assert.ok(claim.spec.resources.requests.storage);
  });

  test(`${variant}: device flag and resources fit the variant`, () => {
    const sts = only(objects, "StatefulSet");
    const pod = sts.spec.template.spec;
    const container = pod.containers[0];
    const args = resolvedArgs(objects, container);
    const gpus = container.resources.limits?.["nvidia.com/gpu"];
    // sharded-4 and mtls build on the gpu overlay.
    const expected = { base: "auto", gpu: "cuda:0", cpu: "cpu", "sharded-4": "cuda:0",
      mtls: "cuda:0" }[variant];
    assert.equal(flagValue(args, "device"), expected);
    if (expected === "cuda:0") {
      assert.equal(gpus, 1, "one GPU per shard");
      assert.ok(pod.tolerations.some((t) => t.key === "nvidia.com/gpu"));
      assert.match(container.image, /cuda/);
    } else {
      assert.equal(gpus, undefined);
    }
    if (variant === "cpu") {
      assert.equal(Number(flagValue(args, "threads")), Number(container.resources.requests.cpu));
      assert.match(container.image, /cpu/);
    }
    assert.ok(container.resources.requests.memory && container.resources.limits.memory);
  });

  if (variant === "base") continue;

  test(`${variant}: the PodMonitor scrapes the pods' metrics port`, () => {
    const monitor = only(objects, "PodMonitor");
    const sts = only(objects, "StatefulSet");
    const podLabels = sts.spec.template.metadata.labels;
    assert.ok(selectorMatches(monitor.spec.selector.matchLabels, podLabels));
    const names = sts.spec.template.spec.containers[0].ports.map((p) => p.name);
    for (const endpoint of monitor.spec.podMetricsEndpoints) {
      assert.ok(names.includes(endpoint.port), `PodMonitor port ${endpoint.port}`);
      assert.equal(endpoint.path, "/metrics");
    }
    // job="fusedps", as deploy/prometheus's rules and the dashboard select it.
    assert.equal(podLabels[monitor.spec.jobLabel], "fusedps");
  });

  test(`${variant}: the PrometheusRules hold deploy/prometheus/rules exactly`, () => {
    const objects_ = objects.filter((o) => o.kind === "PrometheusRule");
    const files = readRuleFiles();
    assert.equal(objects_.length, files.length, "one PrometheusRule per rules file");
    for (const { file, rules } of files) {
      const match = objects_.find((o) => isDeepStrictEqual(o.spec, rules));
      assert.ok(match, `no PrometheusRule with the groups of deploy/prometheus/rules/${file}`);
      assert.ok(match.spec.groups.length > 0);
    }
  });

  test(`${variant}: the Grafana dashboards ConfigMap holds deploy/grafana exactly`, () => {
    const dir = join(sourceDir, "deploy/grafana");
    const maps = objects.filter((o) => o.kind === "ConfigMap" && o.metadata.labels?.grafana_dashboard);
    assert.equal(maps.length, 1);
    assert.equal(maps[0].metadata.labels.grafana_dashboard, "1");
    const files = readdirSync(dir).filter((f) => f.endsWith(".json"));
    assert.deepEqual(Object.keys(maps[0].data).sort(), files.sort());
    for (const file of files) {
      assert.deepEqual(
        JSON.parse(maps[0].data[file]),
        JSON.parse(readFileSync(join(dir, file), "utf8")),
        `${file} differs from deploy/grafana/${file}`,
      );
    }
  });
}

// One runbook page per alert (docs/operations/runbooks/ALERTNAME.md, lower case), named by the
// alert's runbook_url and listed in the runbooks' index.
test("every alert in deploy/prometheus/rules has a runbook page that its runbook_url names", () => {
  const alerts = readRuleFiles().flatMap(({ rules }) =>
    rules.groups.flatMap((group) => group.rules.filter((r) => r.alert)),
  );
  assert.ok(alerts.length > 0, "no alerts found");
  const index = readFileSync(join(sourceDir, "docs/operations/runbooks/README.md"), "utf8");
  for (const rule of alerts) {
    const name = `${rule.alert.toLowerCase()}.md`;
    const page = `docs/operations/runbooks/${name}`;
    assert.equal(rule.annotations?.runbook_url, page, `${rule.alert}: runbook_url`);
    assert.ok(existsSync(join(sourceDir, page)), `${rule.alert}: no page ${page}`);
    const text = readFileSync(join(sourceDir, page), "utf8");
    assert.match(text, new RegExp(`^# ${rule.alert}$`, "m"), `${page} is not titled ${rule.alert}`);
    assert.ok(index.includes(`](${name})`), `the runbooks' README.md does not link ${name}`);
  }
});

// ------------------------------------------------ the sharded example (overlays/sharded-4)

// What the trainers are given, in shard order (docs/operations/deploy.md, "Many trainers, many
// shards"): pod N of the StatefulSet is shard N, named under the headless Service.
const SHARD_TARGETS = [0, 1, 2, 3].map((i) => `fusedps-${i}.fusedps-headless:50051`);
const MODE_FLAGS = ["mode", "total-replicas", "replicas-to-aggregate", "round-timeout-seconds",
  "max-staleness", "staleness-lr-scaling"];

test("sharded-4: 4 shards, each at a stable DNS name of the headless Service", () => {
  const objects = loadObjects("sharded-4");
  const sts = only(objects, "StatefulSet");
  const service = only(objects, "Service");
  assert.equal(sts.spec.replicas, 4);
  assert.equal(sts.spec.serviceName, service.metadata.name);
  assert.equal(service.spec.clusterIP, "None", "headless: one DNS name per pod, no virtual IP");
  const grpc = service.spec.ports.find((p) => p.name === "grpc");
  assert.ok(grpc, "the Service names port grpc");
  // A pod of a StatefulSet is NAME-ORDINAL, and resolves as NAME-ORDINAL.SERVICE in its
  // namespace (and .NAMESPACE.svc.cluster.local in any).
  const names = [...Array(sts.spec.replicas).keys()].map(
    (i) => `${sts.metadata.name}-${i}.${service.metadata.name}:${grpc.port}`,
  );
  assert.deepEqual(names, SHARD_TARGETS);
  // Every shard keeps its own checkpoints: one claim per pod, from the template.
  assert.deepEqual(sts.spec.volumeClaimTemplates.map((t) => t.metadata.name), ["checkpoints"]);
  assert.equal(sts.spec.persistentVolumeClaimRetentionPolicy.whenScaled, "Retain");
});

test("sharded-4: every shard runs sync mode, K of N with a backup, and a round timeout", () => {
  const objects = loadObjects("sharded-4");
  const container = only(objects, "StatefulSet").spec.template.spec.containers[0];
  const args = resolvedArgs(objects, container);
  assert.equal(flagValue(args, "mode"), "sync");
  const total = Number(flagValue(args, "total-replicas"));
  const aggregate = Number(flagValue(args, "replicas-to-aggregate"));
  const timeout = Number(flagValue(args, "round-timeout-seconds"));
  assert.equal(total, 8);
  assert.equal(aggregate, 7);
  assert.ok(Number.isInteger(aggregate) && aggregate >= 1 && aggregate <= total, "1 <= K <= N");
  assert.equal(timeout, 30);
  // bounded mode's flags have no place in sync mode.
  assert.equal(flagValue(args, "max-staleness"), undefined);
  assert.ok(!args.some((a) => a.startsWith("--staleness-lr-scaling")));
  // The values come from the one ConfigMap that every pod reads, so all shards agree.
  for (const flag of ["mode", "total-replicas", "replicas-to-aggregate", "round-timeout-seconds"]) {
    const raw = container.args.find((a) => a.startsWith(`--${flag}=`));
    assert.match(raw, /^--[-a-z]+=\$\(FUSEDPS_[A-Z_]+\)$/, `--${flag} from fusedps-flags`);
  }
});

test("sharded-4: apart from the replicas and the mode flags, it is the gpu overlay", () => {
  const normalized = (variant) => {
    const objects = loadObjects(variant);
    const sts = structuredClone(only(objects, "StatefulSet"));
    const container = sts.spec.template.spec.containers[0];
    const args = resolvedArgs(objects, container).filter(
      (a) => !MODE_FLAGS.some((f) => a === `--${f}` || a.startsWith(`--${f}=`)),
    );
    delete sts.spec.replicas;
    delete container.args;
    delete container.command;
    delete container.envFrom; // The ConfigMap's name carries a hash of its content.
    return { sts, args, kinds: objects.map((o) => `${o.kind} ${o.metadata.name}`).sort() };
  };
  const sharded = normalized("sharded-4");
  const gpu = normalized("gpu");
  assert.deepEqual(sharded.args, gpu.args);
  assert.deepEqual(sharded.sts, gpu.sts);
  const unhashed = (kinds) => kinds.map((k) => k.replace(/^(ConfigMap fusedps-flags)-.*/, "$1"));
  assert.deepEqual(unhashed(sharded.kinds), unhashed(gpu.kinds));
});

// Clients are configured by hand from these names: a doc or manifest comment that names a
// shard under another domain (fusedps-0.fusedps, say) sends trainers to a name that does not
// resolve.
test("the docs and manifests name the shards under the headless Service", () => {
  const service = only(loadObjects("sharded-4"), "Service").metadata.name;
  const files = [
    "README.md",
    ...readdirSync(join(sourceDir, "docs"), { recursive: true })
      .filter((f) => f.endsWith(".md"))
      .map((f) => `docs/${f}`),
    ...readdirSync(join(sourceDir, "deploy/k8s"), { recursive: true })
      .filter((f) => /\.ya?ml$/.test(f) && statSync(join(sourceDir, "deploy/k8s", f)).isFile())
      .map((f) => `deploy/k8s/${f}`),
  ];
  let seen = 0;
  for (const file of files) {
    const text = readFileSync(join(sourceDir, file), "utf8");
    for (const match of text.matchAll(/(?<![-\w])fusedps-(\d+|N|i)\.([a-z][-a-z0-9]*)/g)) {
      seen += 1;
      assert.equal(match[2], service, `${file}: ${match[0]} is not under Service ${service}`);
    }
  }
  assert.ok(seen >= 4, "the docs name the shards somewhere");
});

// ------------------------------------ mutual TLS and cert-manager's certificates (overlays/mtls)

test("mtls: cert-manager issues the servers' Secret, with the names and usages probes need", () => {
  const objects = loadObjects("mtls");
  const pod = only(objects, "StatefulSet").spec.template.spec;
  const container = pod.containers[0];
  const args = resolvedArgs(objects, container);
  const tlsSecret = secretMountOf(pod, container, flagValue(args, "tls-cert"), "--tls-cert")
    .volume.secret.secretName;
  const certificates = objects.filter((o) => o.kind === "Certificate");
  const issuers = objects.filter((o) => o.kind === "Issuer");
  const server = certificates.find((c) => c.spec.secretName === tlsSecret);
  assert.ok(server, `no Certificate writes the Secret ${tlsSecret}`);
  // The probes connect to localhost (or 127.0.0.1) and check the certificate's names.
  const names = [...(server.spec.dnsNames ?? []), ...(server.spec.ipAddresses ?? [])];
  for (const probe of PROBES) {
    const host = hostOf(flagValue(container[probe].exec.command, "target"));
    assert.ok(names.includes(host), `${probe} connects to ${host}, not in ${names}`);
  }
  // Shards by their full names, under the headless Service (a wildcard covers them all).
  const service = only(objects, "Service").metadata.name;
  assert.ok(names.some((n) => n.startsWith(`*.${service}.`) && n.endsWith(".svc.cluster.local")));
  // Under mTLS the probes present this certificate as a client's.
  assert.ok(flagValue(args, "tls-client-ca"), "mtls sets --tls-client-ca");
  assert.ok(server.spec.usages.includes("server auth"));
  assert.ok(server.spec.usages.includes("client auth"), "the probes' client certificate");
  // Every Certificate is issued by an Issuer of the output; the CA Issuer's key is a CA's.
  for (const certificate of certificates) {
    const issuer = issuers.find((i) => i.metadata.name === certificate.spec.issuerRef.name);
    assert.ok(issuer, `${certificate.metadata.name}: no Issuer ${certificate.spec.issuerRef.name}`);
    assert.equal(certificate.spec.issuerRef.kind, "Issuer");
    if (issuer.spec.ca) {
      const ca = certificates.find((c) => c.spec.secretName === issuer.spec.ca.secretName);
      assert.equal(ca?.spec.isCA, true, `Issuer ${issuer.metadata.name}: its CA`);
    }
  }
  // A client certificate for the trainers, from the same CA.
  const trainer = certificates.find((c) => c.metadata.name === "fusedps-trainer-tls");
  assert.ok(trainer && trainer.spec.usages.includes("client auth"));
  assert.equal(trainer.spec.issuerRef.name, server.spec.issuerRef.name);
});

test("mtls: apart from the mTLS flags and cert-manager's objects, it is the gpu overlay", () => {
  const MTLS = ["--tls-client-ca=", "--tls-cert=", "--tls-key="];
  const normalized = (variant) => {
    const objects = loadObjects(variant);
    const sts = structuredClone(only(objects, "StatefulSet"));
    const container = sts.spec.template.spec.containers[0];
    for (const probe of PROBES) {
      container[probe].exec.command = container[probe].exec.command.filter(
        (a) => !MTLS.some((f) => a.startsWith(f)));
    }
    const args = container.args.filter((a) => !a.startsWith("--tls-client-ca="));
    delete container.args;
    const kinds = objects
      .filter((o) => !o.apiVersion.startsWith("cert-manager.io/"))
      .map((o) => `${o.kind} ${o.metadata.name}`)
      .sort();
    return { sts, args, kinds };
  };
  assert.deepEqual(normalized("mtls"), normalized("gpu"));
});

// -------------------------------------------------- example trainers (deploy/k8s/examples)

test("examples: the trainers validate and get their token and CA from Secrets", async () => {
  const dir = join(sourceDir, "deploy/k8s/examples");
  const files = readdirSync(dir).filter((f) => /\.ya?ml$/.test(f));
  assert.ok(files.includes("trainers.yaml"));
  for (const file of files) {
    const objects = parseAllDocuments(readFileSync(join(dir, file), "utf8"))
      .map((doc) => doc.toJS())
      .filter((o) => o !== null);
    for (const object of objects) {
      const Model = await modelFor(object.apiVersion, object.kind);
      assert.doesNotThrow(() => new Model(object).validate(), `${file}: ${object.kind}`);
      checkNames(object);
    }
  }
  const job = parseYaml(readFileSync(join(dir, "trainers.yaml"), "utf8"));
  const pod = job.spec.template.spec;
  const container = pod.containers[0];
  const env = Object.fromEntries(container.env.map((e) => [e.name, e.value ?? e.valueFrom]));
  // One trainer per sync replica of the sharded-4 example, each its own principal.
  const sharded = resolvedArgs(loadObjects("sharded-4"),
    only(loadObjects("sharded-4"), "StatefulSet").spec.template.spec.containers[0]);
  assert.equal(job.spec.completionMode, "Indexed");
  assert.equal(job.spec.completions, Number(flagValue(sharded, "total-replicas")));
  assert.match(env.TRAINER_INDEX.fieldRef.fieldPath, /job-completion-index/);
  assert.equal(container.env[0].name, "TRAINER_INDEX", "defined before the values using it");
  assert.equal(env.FUSEDPS_CLIENT_ID, "trainer-$(TRAINER_INDEX)");
  assert.ok(env.FUSEDPS_TOKEN_FILE.endsWith("/trainer-$(TRAINER_INDEX)"));
  // From Secret volumes mounted as directories; never the servers' key or their token file.
  const server = only(loadObjects("gpu"), "StatefulSet").spec.template.spec;
  const serverSecrets = server.volumes.filter((v) => v.secret).map((v) => v.secret.secretName);
  const mounted = ["FUSEDPS_TOKEN_FILE", "FUSEDPS_TLS_CA", "FUSEDPS_TLS_CERT", "FUSEDPS_TLS_KEY"];
  for (const name of mounted) {
    const { volume } = secretMountOf(pod, container, env[name], name);
    assert.ok(!serverSecrets.includes(volume.secret.secretName), `${name}: a server's Secret`);
    assert.equal(volume.secret.defaultMode & 0o007, 0, `${name}: world-readable`);
  }
  // The shards in ordinal order, by their full names in the namespace.
  const targets = env.FUSEDPS_TARGETS.split(",");
  assert.deepEqual(targets.map((t) => t.replace(/\.training\.svc\.cluster\.local:/, ":")),
    SHARD_TARGETS);
});
