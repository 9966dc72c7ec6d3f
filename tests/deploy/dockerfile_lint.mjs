// Lints deploy/docker's Dockerfiles offline. First dockerfile-utils (the Dockerfile linter and
// formatter behind the Docker language server): every instruction and flag valid, no warnings,
// formatted as it formats. Then the rules this project holds its images to, in the spirit of
// hadolint's: pinned base images, the shared setup and build scripts, a multi-stage build whose
// runtime stage copies only build outputs, a non-root user, an exec-form HEALTHCHECK through
// gRPC health, and a .dockerignore that keeps build trees out and sources in.
//
//   node --test dockerfile_lint.mjs      with FUSEDPS_SOURCE_DIR=repo
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { DockerfileParser } from "dockerfile-ast";
import { format, validate } from "dockerfile-utils";

const sourceDir = process.env.FUSEDPS_SOURCE_DIR;
assert.ok(sourceDir, "set FUSEDPS_SOURCE_DIR");

// The server images: their bases (the build-arg defaults: the upstream images that a published
// image builds on) and the rules below. deploy/docker/base-image.sh makes local stand-ins.
const DOCKERFILES = {
  "deploy/docker/Dockerfile": { build: /^nvidia\/cuda:.*-devel-/, run: /^nvidia\/cuda:.*-base-/ },
  "deploy/docker/Dockerfile.cpu": { build: /^debian:12/, run: /^debian:12/ },
};
// The test stack's other images (deploy/compose/docker-compose.test.yml): dockerfile-utils, the
// pinned Debian base, a non-root user and the RUN hygiene, but they install packages in their
// last stage by design.
const OTHER_DOCKERFILES = ["deploy/docker/Dockerfile.prometheus", "deploy/docker/Dockerfile.trainer"];

// Splits a Dockerfile into stages of instructions, with ARG defaults before the first FROM.
function parse(text) {
  const dockerfile = DockerfileParser.parse(text);
  const args = {};
  const stages = [];
  for (const instruction of dockerfile.getInstructions()) {
    const keyword = instruction.getKeyword();
    const content = instruction.getArgumentsContent() ?? "";
    if (keyword === "FROM") {
      const image = instruction.getImage().replace(/\$\{(\w+)\}/g, (_, name) => args[name] ?? "");
      stages.push({ image, name: instruction.getBuildStage(), instructions: [] });
    } else if (stages.length === 0 && keyword === "ARG") {
      const [name, value] = content.split("=");
      args[name.trim()] = value?.trim();
    } else if (stages.length > 0) {
      stages.at(-1).instructions.push({ keyword, content, instruction });
    }
  }
  return stages;
}

const execForm = (content) => {
  const parsed = JSON.parse(content);
  assert.ok(Array.isArray(parsed) && parsed.every((s) => typeof s === "string"), content);
  return parsed;
};

// .dockerignore semantics (Go filepath.Match, plus "**"): a pattern excludes a path when it
// matches the path or one of its parent folders. This file uses no "!" exceptions.
function ignoredBy(patterns, path) {
  const regexes = patterns.map((pattern) => {
    const source = pattern
      .replace(/^\/+|\/+$/g, "")
      .split(/(\*\*\/?|\*|\?)/)
      .map((part) => {
        if (part.startsWith("**")) return "(.*/)?";
        if (part === "*") return "[^/]*";
        if (part === "?") return "[^/]";
        return part.replace(/[.+^${}()|[\]\\]/g, "\\$&");
      })
      .join("");
    return new RegExp(`^${source}$`);
  });
  const parts = path.split("/");
  return parts.some((_, i) => {
    const prefix = parts.slice(0, i + 1).join("/");
    return regexes.some((regex) => regex.test(prefix) || regex.test(`${prefix}/`));
  });
}

for (const [file, bases] of Object.entries(DOCKERFILES)) {
  const text = readFileSync(join(sourceDir, file), "utf8");
  const stages = parse(text);
  const final = stages.at(-1);
  const all = stages.flatMap((stage) => stage.instructions);
  const finalOf = (keyword) => final.instructions.filter((i) => i.keyword === keyword);

  test(`${file}: dockerfile-utils reports nothing`, () => {
    const diagnostics = validate(text).map(
      (d) => `line ${d.range.start.line + 1}: ${d.message} (severity ${d.severity})`,
    );
    assert.deepEqual(diagnostics, []);
  });

  test(`${file}: formatted as dockerfile-utils formats it`, () => {
    const edits = format(text, { insertSpaces: true, tabSize: 4 }).map(
      (e) => `line ${e.range.start.line + 1}: ${JSON.stringify(e.newText)}`,
    );
    assert.deepEqual(edits, []);
  });

  test(`${file}: multi-stage on pinned base images`, () => {
    assert.ok(stages.length >= 2, "a build stage and a runtime stage");
    assert.match(stages[0].image, bases.build);
    assert.match(final.image, bases.run);
    for (const stage of stages) {
      const tag = stage.image.split(":")[1];
      assert.ok(tag && tag !== "latest", `${stage.image}: pin a tag, not latest`);
    }
  });

  test(`${file}: built with scripts/setup.sh and scripts/build.sh`, () => {
    const build = stages[0].instructions.filter((i) => i.keyword === "RUN").map((i) => i.content);
    assert.ok(build.some((c) => /(^|&&\s*)scripts\/setup\.sh\b/.test(c)), "runs scripts/setup.sh");
    assert.ok(build.some((c) => /\bscripts\/build\.sh\b/.test(c)), "runs scripts/build.sh");
    assert.ok(build.some((c) => /deploy\/docker\/collect-runtime\.sh/.test(c)));
  });

  test(`${file}: the runtime stage copies only build outputs`, () => {
    for (const copy of finalOf("COPY")) {
      assert.ok(copy.instruction.getFromFlag(), `runtime COPY without --from: ${copy.content}`);
    }
    for (const { keyword, content } of final.instructions) {
      if (keyword === "RUN") assert.doesNotMatch(content, /apt-get|apt |pip |npm /, content);
    }
  });

  test(`${file}: RUN hygiene (hadolint DL3003, DL3004, DL3020, DL4006, nothing downloaded)`, () => {
    assert.equal(all.filter((i) => i.keyword === "ADD").length, 0, "COPY, not ADD");
    for (const stage of stages) {
      let pipefail = false;
      for (const { keyword, content } of stage.instructions) {
        if (keyword === "SHELL") pipefail = /pipefail/.test(content);
        if (keyword !== "RUN") continue;
        assert.doesNotMatch(content, /\bsudo\b/, "no sudo");
        assert.doesNotMatch(content, /(^|&&|;)\s*cd\s/, "WORKDIR, not cd");
        assert.doesNotMatch(content, /\b(curl|wget)\b/, "nothing downloaded outside apt");
        if (/[^|]\|[^|]/.test(content)) assert.ok(pipefail, `pipe without pipefail: ${content}`);
      }
    }
  });

  test(`${file}: runs as a non-root user`, () => {
    const users = finalOf("USER");
    assert.ok(users.length > 0, "USER in the runtime stage");
    const user = users.at(-1).content.split(":")[0];
    assert.ok(!["0", "root"].includes(user), `USER ${user}`);
    assert.match(user, /^[1-9][0-9]*$/, "a numeric UID, so runAsNonRoot can verify it");
  });

  test(`${file}: exec-form ENTRYPOINT fusedps-server, ports, HEALTHCHECK via gRPC health`, () => {
    assert.equal(finalOf("ENTRYPOINT").length, 1);
    assert.deepEqual(execForm(finalOf("ENTRYPOINT")[0].content), ["fusedps-server"]);
    assert.equal(finalOf("CMD").length, 1);
    execForm(finalOf("CMD")[0].content);
    const exposed = finalOf("EXPOSE").flatMap((i) => i.content.split(/\s+/));
    assert.ok(exposed.includes("50051") && exposed.includes("9464"), `EXPOSE ${exposed}`);
    const healthchecks = finalOf("HEALTHCHECK");
    assert.equal(healthchecks.length, 1);
    const check = healthchecks[0].content.replace(/^(--\S+\s+)*/, "");
    assert.match(check, /^CMD \[/, "exec form");
    const command = execForm(check.slice(4));
    assert.deepEqual(command.slice(0, 2), ["fusedps", "health"]);
  });

  test(`${file}: .dockerignore keeps build trees out and sources in`, () => {
    const patterns = readFileSync(join(sourceDir, ".dockerignore"), "utf8")
      .split("\n")
      .map((line) => line.trim())
      .filter((line) => line && !line.startsWith("#"));
    assert.ok(!patterns.some((p) => p.startsWith("!")), "this check does not handle ! patterns");
    for (const path of [".git/HEAD", "build/server/fusedps-server", "build-py/x", "a/node_modules/b"]) {
      assert.ok(ignoredBy(patterns, path), `${path} should be excluded`);
    }
    const cmake = readFileSync(join(sourceDir, "CMakeLists.txt"), "utf8");
    const needed = [
      "CMakeLists.txt",
      "scripts/setup.sh",
      "scripts/build.sh",
      "deploy/docker/collect-runtime.sh",
      ...[...cmake.matchAll(/add_subdirectory\((\w+)\)/g)].map((m) => `${m[1]}/CMakeLists.txt`),
      ...all
        .filter((i) => i.keyword === "COPY" && !i.instruction.getFromFlag())
        .flatMap((i) => i.content.split(/\s+/).slice(0, -1))
        .filter((source) => source !== "."),
    ];
    for (const path of needed) {
      assert.ok(!ignoredBy(patterns, path), `${path} is needed by the build but excluded`);
    }
  });
}

for (const file of OTHER_DOCKERFILES) {
  const text = readFileSync(join(sourceDir, file), "utf8");
  const stages = parse(text);

  test(`${file}: dockerfile-utils reports nothing, and formatted as it formats`, () => {
    assert.deepEqual(validate(text).map((d) => `line ${d.range.start.line + 1}: ${d.message}`), []);
    assert.deepEqual(format(text, { insertSpaces: true, tabSize: 4 }), []);
  });

  test(`${file}: the Debian 12 base, a non-root user, no downloads outside apt`, () => {
    for (const stage of stages) assert.match(stage.image, /^debian:12/);
    const users = stages.at(-1).instructions.filter((i) => i.keyword === "USER");
    assert.ok(users.length > 0 && !/^(0|root)(:|$)/.test(users.at(-1).content), "USER");
    for (const { keyword, content } of stages.flatMap((stage) => stage.instructions)) {
      assert.notEqual(keyword, "ADD", "COPY, not ADD");
      if (keyword === "RUN") assert.doesNotMatch(content, /\b(curl|wget|sudo)\b/, content);
    }
  });
}
