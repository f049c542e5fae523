// The calculator agent in JavaScript: ordinary `openai` npm client code, written as it would be against OpenAI.
// lightning_ray runs it as a command (task.command=[node, examples/node_calc/calc.mjs]): the client reads
// OPENAI_BASE_URL and OPENAI_API_KEY itself, the model name comes from OPENAI_MODEL, the task as JSON on stdin.
// It prints its answer on the last line. Same protocol as the Python agent (lightning_ray/tasks/calc.py, "text"):
// CALC <expression> lines answered with RESULT lines, then ANSWER <number>.
import OpenAI from "openai";

const SYSTEM = "You have a calculator. Write CALC <expression> with the whole expression to get RESULT <number>. " +
  "Then reply ANSWER <number>, copying the result exactly, including a minus sign.";
const EXAMPLE = [  // one worked example: a small model follows a conversation's pattern more than instructions
  { role: "user", content: "Calculate 7 - 12." }, { role: "assistant", content: "CALC 7 - 12" },
  { role: "user", content: "RESULT -5" }, { role: "assistant", content: "ANSWER -5" },
];
const MAX_TURNS = 3;

// + - * / and parentheses, by recursive descent: nothing else is evaluated
function calculate(text) {
  const tokens = text.match(/\d+(?:\.\d+)?|[-+*/()]|\S/g) ?? [];
  let i = 0;
  const peek = () => tokens[i], take = () => tokens[i++];
  const factor = () => {
    const t = take();
    if (t === "-") return -factor();
    if (t === "+") return factor();
    if (t === "(") { const v = sum(); if (take() !== ")") throw new Error("unbalanced parentheses"); return v; }
    if (t !== undefined && /^\d/.test(t)) return Number(t);
    throw new Error(`unexpected ${t ?? "end"}`);
  };
  const product = () => {
    let v = factor();
    while (peek() === "*" || peek() === "/") {
      const op = take(), r = factor();
      if (op === "/" && r === 0) throw new Error("division by zero");
      v = op === "*" ? v * r : v / r;
    }
    return v;
  };
  const sum = () => {
    let v = product();
    while (peek() === "+" || peek() === "-") v = take() === "+" ? v + product() : v - product();
    return v;
  };
  const value = sum();
  if (i !== tokens.length) throw new Error(`unexpected ${tokens[i]}`);
  return Number.isInteger(value) ? String(value) : String(Math.round(value * 1e6) / 1e6);
}

async function readStdin() {
  let data = "";
  for await (const chunk of process.stdin) data += chunk;
  return JSON.parse(data);
}

const task = await readStdin();
const client = new OpenAI({ maxRetries: 0 });
const messages = [{ role: "system", content: SYSTEM }, ...EXAMPLE, { role: "user", content: task.question }];
let answer = "";
for (let turn = 0; turn < MAX_TURNS; turn++) {
  const reply = await client.chat.completions.create({ model: process.env.OPENAI_MODEL, messages });
  const text = reply.choices[0].message.content ?? "";
  messages.push({ role: "assistant", content: text });
  const final = text.match(/ANSWER:?\s*(-?\d+(?:\.\d+)?)/);
  if (final) { answer = final[1]; break; }
  const call = text.match(/CALC:?\s*([-+*/(). \d]+)/);
  if (!call) { answer = (text.match(/-?\d+(?:\.\d+)?/g) ?? [""]).at(-1); break; }  // its last number
  let result;
  try { result = calculate(call[1]); } catch (e) { result = `error: ${e.message}`; }
  messages.push({ role: "user", content: `RESULT ${result}` });
}
console.log(answer);
