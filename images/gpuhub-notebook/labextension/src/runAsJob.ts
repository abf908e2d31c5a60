/**
 * "Run as job" on the open notebook: the notebook is saved, then executed top to bottom as a
 * batch job in the team's GPU queue (papermill, on the hub's side), with a profile chosen from
 * the spawn page's list, optional parameters, and optionally "and stop my server" to free this
 * server's GPU at once.
 *
 * Everything goes through this server's own relay (`gpuhub/jobs`, the server extension), which
 * talks to the hub with this server's token: the job is always the logged-in user's, and the
 * browser never holds a hub credential. `GET gpuhub/jobs` lists the profiles this user's teams
 * may use (the hub's `GET /hub/api/gpuhub/profiles`); `POST gpuhub/jobs` submits.
 *
 * The form is a dialog of this page's own (plain DOM, no lazily loaded code): with "and stop my
 * server" the server goes away right after it answers, and the result (the job's id and a link
 * to its page on the hub) must still be shown.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export const RUN_AS_JOB = 'gpuhub-notebook:run-as-job';

interface IProfile {
  slug: string;
  displayName: string;
  description: string;
  resources: string;
  gpus: number;
  default: boolean;
}

interface ITeam {
  name: string;
  displayName: string;
  profiles: IProfile[];
}

interface IProfilesReply {
  teams?: ITeam[];
  server?: string;
  message?: string;
}

interface IJobReply {
  id?: string;
  status?: string;
  message?: string;
  issues?: string[];
  stopped_server?: string;
}

/** The notebook open in the main area: its path (relative to the server's root) and a save. */
interface IOpenNotebook {
  path: string;
  save: () => Promise<void>;
}

function currentNotebook(app: JupyterFrontEnd): IOpenNotebook | null {
  const widget: any = app.shell.currentWidget;
  const context = widget && widget.context;
  if (!context || typeof context.path !== 'string' || !context.path.endsWith('.ipynb')) {
    return null;
  }
  return {
    path: context.path,
    save: async () => {
      if (context.model && context.model.dirty) {
        await context.save();
      }
    }
  };
}

/** The job's page on the hub (its own origin under per-user origins). */
function jobPage(id: string): string {
  const prefix = PageConfig.getOption('hubPrefix') || '/hub/';
  const host = PageConfig.getOption('hubHost') || '';
  return host + URLExt.join(prefix, 'gpuhub', 'jobs', encodeURIComponent(id));
}

/** An element with its properties (``style``: CSS text) and children. */
function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  props: { [key: string]: any } = {},
  ...children: (Node | string)[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  const { style, ...rest } = props;
  Object.assign(node, rest);
  if (typeof style === 'string') {
    node.style.cssText = style;
  }
  node.append(...children);
  return node;
}

async function relay<T>(
  settings: ServerConnection.ISettings,
  method: 'GET' | 'POST',
  body?: object
): Promise<{ status: number; body: T }> {
  const url = URLExt.join(settings.baseUrl, 'gpuhub', 'jobs');
  const init: RequestInit = { method, cache: 'no-store' };
  if (body) {
    init.body = JSON.stringify(body);
  }
  const resp = await ServerConnection.makeRequest(url, init, settings);
  let data: any = {};
  try {
    data = await resp.json();
  } catch {
    data = {};
  }
  return { status: resp.status, body: data as T };
}

/**
 * The dialog: profile (the spawn page's list), parameters, "and stop my server". Errors are
 * shown in it and nothing typed is lost; after a submission it shows the job's id, its first
 * status line and a link to its page.
 */
class RunAsJobDialog {
  constructor(
    private settings: ServerConnection.ISettings,
    private notebook: IOpenNotebook
  ) {
    this.node = el('div', {
      id: 'gpuhub-run-as-job',
      className: 'gpuhub-run-as-job'
    });
    this.node.setAttribute('role', 'dialog');
    this.node.setAttribute('aria-label', 'Run as job');
    this.node.style.cssText =
      'position:fixed;inset:0;z-index:100001;display:flex;align-items:center;justify-content:center;' +
      'background:rgba(0,0,0,.35);font:var(--jp-ui-font-size1,13px) var(--jp-ui-font-family,sans-serif)';
    this.box = el('div');
    this.box.style.cssText =
      'background:var(--jp-layout-color1,#fff);color:var(--jp-ui-font-color1,#000);border-radius:4px;' +
      'box-shadow:0 4px 16px rgba(0,0,0,.4);padding:16px 20px;min-width:420px;max-width:640px;' +
      'max-height:85vh;overflow:auto';
    this.node.append(this.box);
    this.node.addEventListener('keydown', e => {
      if (e.key === 'Escape' && !this.busy) {
        this.close();
      }
    });
  }

  async open(): Promise<void> {
    document.body.append(this.node);
    this.box.replaceChildren(
      el('h2', { textContent: 'Run as job', style: 'margin:0 0 8px' }),
      el('p', { textContent: `Loading the profiles your team may use\u2026` })
    );
    let reply: { status: number; body: IProfilesReply };
    try {
      reply = await relay<IProfilesReply>(this.settings, 'GET');
    } catch (err) {
      this.fatal(`The hub could not be asked for your profiles: ${err}`);
      return;
    }
    const teams = reply.body.teams || [];
    if (reply.status !== 200 || !teams.length) {
      this.fatal(reply.body.message || `The hub answered ${reply.status}.`);
      return;
    }
    this.form(teams);
  }

  close(): void {
    this.node.remove();
  }

  private fatal(message: string): void {
    this.box.replaceChildren(
      el('h2', { textContent: 'Run as job', style: 'margin:0 0 8px' }),
      el('p', { className: 'gpuhub-job-error', textContent: message }),
      this.buttons([['Close', 'jp-mod-reject', () => this.close()]])
    );
  }

  private buttons(spec: [string, string, () => void][]): HTMLElement {
    const row = el('div', { style: 'display:flex;justify-content:flex-end;gap:8px;margin-top:12px' });
    for (const [label, kind, onClick] of spec) {
      const b = el('button', {
        type: 'button',
        className: `jp-Dialog-button jp-mod-styled ${kind}`,
        textContent: label
      });
      b.addEventListener('click', onClick);
      row.append(b);
    }
    return row;
  }

  private form(teams: ITeam[]): void {
    const title = el('h2', { textContent: 'Run as job', style: 'margin:0 0 4px' });
    const what = el('p', {
      style: 'margin:0 0 12px;color:var(--jp-ui-font-color2,#555)',
      textContent:
        `${this.notebook.path} runs top to bottom as a job in your team's queue ` +
        '(saved first). Its executed notebook and MLflow runs open from the jobs page.'
    });
    const parts: HTMLElement[] = [title, what];
    let teamSelect: HTMLSelectElement | null = null;
    if (teams.length > 1) {
      teamSelect = el('select', { id: 'gpuhub-job-team', className: 'jp-mod-styled' });
      for (const t of teams) {
        teamSelect.append(el('option', { value: t.name, textContent: t.displayName }));
      }
      parts.push(
        el('label', { htmlFor: 'gpuhub-job-team', textContent: 'Team ', style: 'display:block;margin-bottom:8px' }, teamSelect)
      );
    }
    const sets: HTMLFieldSetElement[] = [];
    for (const t of teams) {
      const set = el('fieldset', { className: 'gpuhub-job-profiles', style: 'border:0;padding:0;margin:0 0 8px' });
      set.dataset.team = t.name;
      set.append(el('legend', { textContent: 'Profile', style: 'font-weight:bold;margin-bottom:4px' }));
      for (const p of t.profiles) {
        const id = `gpuhub-job-profile-${t.name}-${p.slug}`;
        const input = el('input', { type: 'radio', name: `gpuhub-job-profile-${t.name}`, id, value: p.slug });
        input.checked = p.default;
        const label = el(
          'label',
          { htmlFor: id, style: 'margin-left:4px' },
          el('strong', { textContent: p.displayName }),
          ' ',
          el('small', { textContent: `(${p.resources})`, style: 'color:var(--jp-ui-font-color2,#555)' })
        );
        if (p.description) {
          label.append(el('br'), p.description);
        }
        set.append(el('div', { className: 'gpuhub-job-profile', style: 'margin-bottom:4px' }, input, label));
      }
      if (!t.profiles.length) {
        set.append(el('p', { textContent: `${t.displayName} has no profiles.` }));
      }
      sets.push(set);
      parts.push(set);
    }
    const showTeam = () => {
      const name = teamSelect ? teamSelect.value : teams[0].name;
      for (const s of sets) {
        s.style.display = s.dataset.team === name ? '' : 'none';
      }
    };
    if (teamSelect) {
      teamSelect.addEventListener('change', showTeam);
    }
    showTeam();
    const params = el('textarea', {
      id: 'gpuhub-job-parameters',
      className: 'jp-mod-styled',
      rows: 3,
      placeholder: 'lr=0.01\nepochs=20',
      style: 'width:100%;box-sizing:border-box;font-family:var(--jp-code-font-family,monospace)'
    });
    parts.push(
      el(
        'label',
        { htmlFor: 'gpuhub-job-parameters', style: 'display:block;margin-top:4px' },
        'Parameters (optional, one name=value a line; they go after the cell tagged ',
        el('code', { textContent: 'parameters' }),
        ')'
      ),
      params
    );
    const stop = el('input', { type: 'checkbox', id: 'gpuhub-job-stop-server' });
    parts.push(
      el(
        'div',
        { style: 'margin-top:8px' },
        stop,
        el('label', {
          htmlFor: 'gpuhub-job-stop-server',
          style: 'margin-left:4px',
          textContent: 'and stop my server (frees its GPU at once; your files are kept)'
        })
      )
    );
    const error = el('div', { id: 'gpuhub-job-error', className: 'gpuhub-job-error', role: 'alert' });
    error.style.cssText = 'color:var(--jp-error-color1,#d32f2f);white-space:pre-wrap;margin-top:8px';
    parts.push(error);
    const submit = async () => {
      if (this.busy) {
        return;
      }
      const team = teamSelect ? teamSelect.value : teams[0].name;
      const set = sets.find(s => s.dataset.team === team);
      const chosen = set ? set.querySelector<HTMLInputElement>('input[type=radio]:checked') : null;
      if (!chosen) {
        error.textContent = 'Choose a profile.';
        return;
      }
      this.busy = true;
      error.textContent = '';
      row.querySelectorAll('button').forEach(b => (b.disabled = true));
      try {
        await this.notebook.save();
        const body: any = {
          path: this.notebook.path,
          profile: chosen.value,
          parameters: params.value,
          stop_server: stop.checked
        };
        if (teams.length > 1) {
          body.team = team;
        }
        const reply = await relay<IJobReply>(this.settings, 'POST', body);
        if (reply.status === 201 && reply.body.id) {
          this.done(reply.body, stop.checked);
          return;
        }
        const issues = (reply.body.issues || []).join('\n');
        error.textContent =
          (reply.body.message || `The hub answered ${reply.status}.`) + (issues ? `\n${issues}` : '');
      } catch (err) {
        error.textContent = `Not submitted: ${err}`;
      } finally {
        this.busy = false;
        row.querySelectorAll('button').forEach(b => (b.disabled = false));
      }
    };
    const row = this.buttons([
      ['Cancel', 'jp-mod-reject', () => this.close()],
      ['Submit job', 'jp-mod-accept', () => void submit()]
    ]);
    parts.push(row);
    this.box.replaceChildren(...parts);
  }

  private done(job: IJobReply, stopping: boolean): void {
    const id = job.id as string;
    const link = el('a', {
      id: 'gpuhub-job-link',
      href: jobPage(id),
      target: '_blank',
      rel: 'noopener',
      textContent: 'Open the job\u2019s page'
    });
    const parts: (Node | string)[] = [
      el('h2', { textContent: 'Job submitted', style: 'margin:0 0 8px' }),
      el('p', { id: 'gpuhub-job-id' }, 'Job ', el('code', { textContent: id }), ': ', job.status || 'queued'),
      el('p', {}, link, ' (executed notebook, log, MLflow runs).')
    ];
    if (stopping) {
      const how = job.stopped_server === 'stopping' ? 'This server is stopping' : `This server: ${job.stopped_server || 'not stopped'}`;
      parts.push(el('p', { id: 'gpuhub-job-server', textContent: `${how}; its GPU goes to the queue. Your files are kept.` }));
    }
    this.box.replaceChildren(...parts, this.buttons([['Close', 'jp-mod-accept', () => this.close()]]));
  }

  readonly node: HTMLDivElement;
  private box: HTMLDivElement;
  private busy = false;
}

/** Adds the command; menus, the notebook toolbar and the palette come from the plugin's schema. */
export function addRunAsJob(app: JupyterFrontEnd): void {
  app.commands.addCommand(RUN_AS_JOB, {
    label: 'Run as Job\u2026',
    caption: 'Run this notebook top to bottom as a job in your team\u2019s GPU queue',
    isEnabled: () => currentNotebook(app) !== null,
    execute: async () => {
      const notebook = currentNotebook(app);
      if (!notebook) {
        return;
      }
      const dialog = new RunAsJobDialog(app.serviceManager.serverSettings, notebook);
      await dialog.open();
    }
  });
}
